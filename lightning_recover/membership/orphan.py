"""Salvage: an orphan's life in its own process, from the repair that orphaned it to its seat in a re-formed replica.

A live rank of a broken replica raises :class:`~lightning_recover.comm.lobby.Orphaned` from the
repair (``recover.salvage``). The exception leaves the training loop -- Lightning runs its
``on_exception`` and ``teardown`` and re-raises it, and a user's ``except Exception`` does not
catch it -- and reaches the crash hook, where :func:`handle` takes over:

1. it waits, sleeping, for the leader's seat on its lobby, at most ``recover.salvage_wait_s``
   (not seated by then: it leaves through the replica-consistency gate, as it would have);
2. seated, it builds its re-formation's communicator, spawns the ranks no orphan fills (re-join
   on), connects to the survivors and merges
   (:func:`~lightning_recover.comm.orphans.connect_orphans`), within ``rejoin.timeout_s`` like any
   replacement;
3. it runs the user's script again, as a replacement of its seat
   (:func:`~lightning_recover.membership.replacement.run_seat`): the model and the Trainer are
   built again, the live state arrives over the state transfer, and training goes on. Its
   interpreter, its imports and (on a GPU) its CUDA context are the ones it had;
4. if that replica loses a mate in turn, the script's run raises ``Orphaned`` again and the
   process goes back to 1 (it is still a process of the launch).

The strategy installs :func:`handle` with :func:`arm` when salvage is on.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, NoReturn

from lightning_recover.comm.lobby import Lobby, Orphaned
from lightning_recover.comm.orphans import LEAVE, OrphanSeat, await_seat, connect_orphans
from lightning_recover.membership import admission_timer, handshake
from lightning_recover.membership.replacement import run_seat
from lightning_recover.membership.seat import Seat
from lightning_recover.runtime import lifecycle

__all__ = ["arm", "handle"]

_wait_s: float | None = None


def arm(wait_s: float) -> None:
    """Salvage is on in this process: an orphan waits ``wait_s`` seconds for its seat (installed once)."""
    global _wait_s
    if _wait_s is None:
        lifecycle.before_crash(handle)
    _wait_s = wait_s


def handle(exc: BaseException, rank: int | None) -> None:
    """The crash hook's first look: an :class:`Orphaned` rank waits for its seat and never returns here."""
    if isinstance(exc, Orphaned) and _wait_s is not None:
        _live_on(exc, -1 if rank is None else rank, _wait_s)


def _live_on(exc: Orphaned, rank: int, wait_s: float) -> NoReturn:
    # Called from inside the crash hook, where an outer hook (torch's) may have swapped in a buffer
    # that only a dying process would leave behind: this one lives on, and its script prints too.
    sys.stderr = lifecycle.real_stderr()
    while True:
        print(f"[lightning-recover] rank {rank}: {exc}; it waits for a seat in a re-formed replica, at most {wait_s:g} s "
              "(recover.salvage_wait_s)", file=sys.stderr, flush=True)
        lobby = exc.lobby
        # The old Trainer, model and job are held by the finished frames of the traceback: let them go.
        traceback.clear_frames(exc.__traceback__)
        del exc
        seat, msg, team, merged = _seat(lobby, rank, wait_s)
        print(f"[lightning-recover] rank {rank}: seated as rank {msg.rank} of a re-formed replica; the script runs again",
              file=sys.stderr, flush=True)
        try:
            run_seat(seat, merged, list(sys.argv), children=team)
        except Orphaned as again:
            # Its re-formed replica lost a mate in turn: it is an orphan again (it is still a process of the launch).
            admission_timer.left_the_world()
            exc, rank = again, msg.rank
            continue
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
            lifecycle.exit_now(code)
        lifecycle.exit_now(0)


def _seat(lobby: Lobby, rank: int, wait_s: float) -> tuple[Seat, OrphanSeat, Any, Any]:
    """Wait on ``lobby`` for a seat, connect with the re-formed replica's other ranks and the survivors; or leave."""
    msg = await_seat(lobby, wait_s)
    if msg is None:
        lifecycle.gate_exit(rank, f"an orphan not seated within {wait_s:g} s (recover.salvage_wait_s)")
    if msg.rank == LEAVE:
        lifecycle.gate_exit(rank, f"an orphan not seated: {msg.seat}")
    seat = Seat.from_json(msg.seat)
    # From its seat on it is bounded like any replacement: a mate, a rank it spawns or the survivors may
    # die unreported and leave it in a connect or a spawn that never returns.
    admission_timer.leave_after(float(seat.context.get("timeout_s", 120.0)), f"for rank {msg.rank} (orphan rank {rank})",
                                leave=lambda why: lifecycle.gate_exit(rank, f"a seated orphan {why} (recover.rejoin.timeout_s)"))
    connected = connect_orphans(msg)
    if connected is None:
        lifecycle.gate_exit(rank, "an orphan whose re-formed replica could not be merged (a mate or the survivors failed)")
    team, merged = connected
    handshake.say_hello(merged)
    lifecycle.reseat(msg.rank)
    return seat, msg, team, merged
