"""Warm standbys: the leader keeps replica-sized sets of processes started ahead of any loss.

**Warm standbys** (``recover.rejoin.standbys = n``). A cold replacement spends most of its
time before the loss could matter to it: starting Python and MPI, importing torch and
Lightning, running the script's set-up (on this project's 2-core machine, 8-15 s of the
13-29 s measured from the kill to contributing again). So the leader keeps ``n`` standbys
spawned ahead of any loss, each one replica's processes::

    SPAWN    the leader alone Spawns S processes from MPI_COMM_SELF (a background thread;
             the next one only once the others are warm) and Merges them into a *link*
             (leader rank 0). They run ``python -m lightning_recover.cli.joiner --standby``:
             say hello (pid) on the link, import the strategy and the installed packages the
             script imports at its top level (nothing of the user's own code; during training
             at idle priority, :mod:`lightning_recover.runtime.priority`), say WARM, and
             sleep, looking at the link every
             :data:`~lightning_recover.membership.handshake.STANDBY_POLL_S` (no core taken).
    SEAT     a replica is lost: at the next boundary the leader sends a warm standby the
             lost replica's seat (no collective: only the leader knows its standbys). The
             standby starts its timer and runs the script as that replica's ranks, up to
             admission, where it sends CONNECT on the link.
    START    at the first boundary after CONNECT the leader decides START for that replica;
             every survivor duplicates its world and Accepts on a port the leader opened and
             sent over the link (a background thread); the standby Connects and both sides
             Merge (survivors first). From here on it is a replacement like any other: READY,
             ADMIT or DROP (:mod:`lightning_recover.membership.recruiter`).

Why the merge waits for the script: a standby's merged communicator is made from the
survivors' world *after* its script set up, so a loss among the survivors during the
script costs nothing; a loss during the short merge-and-admit window drops the attempt as
usual (a repair), but a standby's replacement that was merged keeps its seat and sends
CONNECT again (its timer restarts); one not merged yet may be blocked in its Connect for
good, so the leader ends it and seats another (``Recruiter.drop``). ``MPI_Intercomm_create`` between the link and the world would need no port,
but it crashed Open MPI 5.0.11's ``coll/han`` on the merged communicator here;
Accept/Connect exchanges what ``han`` needs. A standby whose leader dies leaves by itself
(an MPI error on the link, or the leader's pid gone from this host); the new leader spawns
its own. At the end of training the leader tells its standbys to leave (``quit``) and
fences (SIGKILL, same host) those that never said hello. A standby that dies is counted:
after ``rejoin.attempts`` in a row the leader spawns no more and replacements are spawned
cold again.

Here: :class:`Standby`, one standby as the leader sees it, and :class:`WarmStandbys`, the
leader's keeping of them (SPAWN and SEAT, deaths, dismissal), a part of the
:class:`~lightning_recover.membership.recruiter.Recruiter`, which starts and admits the
attempts (START and after). The standby's own side is the joiner's ``--standby`` mode and
:mod:`lightning_recover.membership.handshake`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lightning_recover.membership.handshake import TAG_CONNECT, TAG_HELLO, TAG_SEAT, TAG_WARM, host_checksum
from lightning_recover.membership.seat import Seat
from lightning_recover.runtime import lifecycle, priority

if TYPE_CHECKING:
    from lightning_recover.comm.communicator import FaultTolerantComm

__all__ = ["OpenAttempt", "Standby", "WarmStandbys"]

#: How often the leader looks at its standbys while the first step waits for them to be warm.
STANDBY_WAIT_POLL_S = 0.05
#: How often that wait says it is still waiting.
STANDBY_WAIT_SHOW_S = 10.0


def _mpi() -> Any:
    """``mpi4py.MPI``, imported on first use: the import initializes MPI, which the joiner does itself first."""
    from mpi4py import MPI

    return MPI


@dataclass
class Standby:
    """One warm standby as the leader sees it: one replica's processes, spawned ahead of a loss."""

    number: int
    spawned_at: float = field(default_factory=time.time)
    thread: threading.Thread | None = None
    #: The leader (rank 0) and the standby's processes (ranks 1..S, in their own world's order).
    link: Any = None
    error: str | None = None
    #: What each process said right after its merge with the leader: pid, start time, host checksum.
    procs: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: Link ranks that finished their imports (TAG_WARM).
    warm: set[int] = field(default_factory=set)
    #: The replica it was seated for (its script runs as that replica's ranks), None while idle.
    replica: int | None = None
    #: Link ranks whose script reached admission and asked to be merged (TAG_CONNECT).
    connecting: set[int] = field(default_factory=set)
    #: Whether the leader gave its warm-up full priority (a loss found no standby warm).
    promoted: bool = False

    def alive_on_this_host(self) -> bool:
        """False when a process of it that said hello on this host is gone (SIGKILL, exit)."""
        host = host_checksum()
        return all(lifecycle.process_start_time(pid) == str(start)
                   for pid, start, where in self.procs.values() if where == host and start >= 0)


class OpenAttempt(Protocol):
    """What the keeping of standbys reads of the recruiter's open attempt
    (a :class:`~lightning_recover.membership.recruiter.JoinAttempt`)."""

    @property
    def replicas(self) -> tuple[int, ...]: ...

    @property
    def standby(self) -> Standby | None: ...


class WarmStandbys:
    """The leader's warm standbys, kept at every step boundary (:meth:`tend`): a base of
    :class:`~lightning_recover.membership.recruiter.Recruiter`, which owns the state below."""

    # The recruiter's state these methods share (set in Recruiter.__init__).
    comm: FaultTolerantComm
    attempts: int
    timeout_s: float
    argv: list[str]
    attempt: OpenAttempt | None
    started_attempts: int
    _sent: list[np.ndarray]
    standbys: int
    shards: int
    pool: list[Standby]
    seated: list[Standby]
    spawned_standbys: int
    standby_failures: int
    _training: bool

    if TYPE_CHECKING:
        # The recruiter's, which the standbys share with its cold spawns.
        @property
        def missing(self) -> tuple[int, ...]: ...

        def _context(self) -> dict[str, Any]: ...

        def _spawn_info(self) -> Any: ...

        def orphans_will_seat(self) -> set[int]: ...

    def serving_standbys(self) -> bool:
        """Whether this job's missing replicas come from standbys (else from cold spawns): the leader's view."""
        return self.standbys > 0 and (bool(self.pool) or bool(self.seated)) and self.standby_failures < self.attempts

    def tend(self, *, training: bool = True) -> None:
        """The leader, at every step boundary: keep :attr:`standbys` standbys, seat idle ones on missing
        replicas, and notice deaths. Never blocks and sends only to processes that said hello.
        ``training=False`` (the job still sets up): a standby spawned now imports at full priority."""
        if not self.comm.is_leader or self.standbys <= 0:
            return
        self._training = training
        now = time.time()
        for sb in [*self.pool, *self.seated]:
            self._poll_standby(sb)
            if sb.error is None and len(sb.warm) < self.shards and now - sb.spawned_at > self.timeout_s:
                # A stopped or wedged standby never says WARM: without this, its seat would wait forever.
                sb.error = f"not warm {self.timeout_s:g} s after its spawn (recover.rejoin.timeout_s)"
            if sb.error is not None and (self.attempt is None or self.attempt.leader.standby is not sb):
                self._forget(sb, sb.error)
        self._seat_idle_standbys()
        started = 0
        # While the job sets up, every standby starts at once: their imports overlap the job's own
        # start-up, and a loss in the first steps finds them all ready or nearly (one after the other,
        # the second was ready 7 s after an early loss, where torchft's restart takes 5 s). During
        # training one starts at a time: on hosts whose cores the training ranks use, two importing
        # torch at once would both be ready late, where one after the other has the first ready early.
        while (len(self.pool) < self.standbys and self.standby_failures < self.attempts
               and (not training or all(len(sb.warm) == self.shards for sb in self.pool))):
            self._spawn_standby()
            started += 1
        if started and not training:
            print(f"[lightning-recover] {started} warm standby(s) starting while the job sets up (recover.rejoin.standbys)",
                  file=sys.stderr, flush=True)

    def unserved(self) -> tuple[int, ...]:
        """The leader's: lost replicas that neither a seated standby nor the open attempt serves."""
        taken = {sb.replica for sb in self.seated}
        if self.attempt is not None:
            taken.update(self.attempt.replicas)
        return tuple(r for r in self.missing if r not in taken)

    def _seat_idle_standbys(self) -> None:
        """Seat warm standbys on the lost replicas that have none, except those waiting orphans re-form
        (salvage comes first: it keeps a broken replica's healthy ranks working)."""
        if len(self.comm.alive_replicas) >= self.comm.layout.replicas:
            return  # the steady step: nothing lost, and no pass over the replicas
        unserved = self.unserved()
        if unserved:
            salvaged = self.orphans_will_seat()
            unserved = tuple(r for r in unserved if r not in salvaged)
        for r in unserved:
            idle = next((sb for sb in self.pool if len(sb.warm) == self.shards), None)
            if idle is None:
                self._promote_warming()
                break
            self._seat(idle, r)

    def await_warm(self, limit_s: float) -> None:
        """The leader, before the first step: tend the standbys until every one is warm, at most ``limit_s``.

        The training ranks wait meanwhile (they leave the cores to the standbys' imports), so
        a loss in the first steps finds a standby ready instead of one still importing torch.
        A standby that dies or fails to spawn is forgotten by :meth:`tend` and no longer
        waited for; a spawn that hangs costs at most ``limit_s``."""
        if not self.comm.is_leader or self.standbys <= 0 or limit_s <= 0:
            return
        t0 = shown = time.monotonic()
        while cold := sum(len(sb.warm) < self.shards for sb in self.pool):
            now = time.monotonic()
            if now - t0 >= limit_s:
                print(f"[lightning-recover] {cold} standby(s) not warm after {limit_s:g} s "
                      "(recover.rejoin.standbys_wait_s): training starts, they warm up beside it",
                      file=sys.stderr, flush=True)
                return
            if now - shown >= STANDBY_WAIT_SHOW_S:
                shown = now
                print(f"[lightning-recover] waiting for {cold} standby(s) to be warm: {now - t0:.0f} s of at most "
                      f"{limit_s:g} s (recover.rejoin.standbys_wait_s)", file=sys.stderr, flush=True)
            time.sleep(STANDBY_WAIT_POLL_S)
            self.tend(training=False)
        if self.pool:
            print(f"[lightning-recover] {len(self.pool)} warm standby(s) ready {time.monotonic() - t0:.1f} s "
                  "into the job's set-up; training starts", file=sys.stderr, flush=True)

    def _forget(self, sb: Standby, reason: str) -> None:
        if sb in self.pool:
            self.pool.remove(sb)
        if sb in self.seated:
            self.seated.remove(sb)
        self.standby_failures += 1
        self._fence_standby(sb, reason)
        print(f"[lightning-recover] standby {sb.number} lost: {reason}"
              + ("" if self.standby_failures < self.attempts else
                 f"; {self.attempts} in a row (recover.rejoin.attempts): replacements are spawned cold from now on"),
              file=sys.stderr, flush=True)

    def _spawn_standby(self) -> None:
        """Spawn one standby (one replica's processes) from this process alone, in a background thread."""
        MPI = _mpi()
        self.spawned_standbys += 1
        sb = Standby(self.spawned_standbys)
        start = lifecycle.process_start_time(os.getpid())
        from lightning_recover.comm import mpi_wait

        # On a host whose cores the job's ranks already share, a standby spawned during training
        # would take cores from it: it yields them (lightning_recover.runtime.priority). One spawned
        # while the job sets up races the job's first loss instead, at full priority.
        spec = {"number": sb.number, "leader_pid": os.getpid(), "leader_start": start, "leader_host": host_checksum(),
                "spawned_at": sb.spawned_at, "yield_cpu": mpi_wait.polite() and self._training, "timeout_s": self.timeout_s}
        args = ["-m", "lightning_recover.cli.joiner", "--standby", json.dumps(spec), *self.argv]
        info = self._spawn_info()
        # Spawn is collective over its communicator: standbys spawned at once from their own threads
        # must not share one (two collectives in flight on one communicator are erroneous in MPI).
        parent = MPI.COMM_SELF.Dup()

        def spawn() -> None:
            try:
                inter = parent.Spawn(sys.executable, args=args, maxprocs=self.shards, info=info, root=0)
                link = inter.Merge(high=False)
                link.Set_errhandler(MPI.ERRORS_RETURN)
                sb.link = link
            except MPI.Exception as exc:
                sb.error = f"spawn failed: {exc.Get_error_string()}"
            finally:
                parent.Free()

        sb.thread = threading.Thread(target=spawn, name=f"lightning-recover-standby-{sb.number}", daemon=True)
        self.pool.append(sb)
        sb.thread.start()

    def _promote_warming(self) -> None:
        """A replica is missing and no standby is warm: the ones still importing behind the training
        ranks (at idle priority) are needed now, so those on this host get their full share."""
        host = host_checksum()
        for sb in self.pool:
            if sb.promoted or len(sb.warm) == self.shards or len(sb.procs) < self.shards:
                continue  # one that has not said hello yet is promoted at a later boundary
            sb.promoted = True
            for pid, start, where in sb.procs.values():
                if where == host and lifecycle.process_start_time(pid) == str(start) and priority.promote(pid):
                    print(f"[lightning-recover] standby {sb.number} (pid {pid}) is needed before it is warm: "
                          "its imports get their full share of the cores", file=sys.stderr, flush=True)

    def _poll_standby(self, sb: Standby) -> None:
        """Read what a standby said (hello, warm, connect) without blocking; a dead one gets ``error``."""
        MPI = _mpi()
        if sb.link is None or sb.error is not None:
            return
        status = MPI.Status()
        buf = np.zeros(3, dtype=np.int64)
        try:
            for tag in (TAG_HELLO, TAG_WARM, TAG_CONNECT):
                while sb.link.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
                    src = status.Get_source()
                    sb.link.Recv([buf, MPI.INT64_T], source=src, tag=tag)
                    if tag == TAG_HELLO:
                        sb.procs[src] = (int(buf[0]), int(buf[1]), int(buf[2]))
                    elif tag == TAG_WARM:
                        sb.warm.add(src)
                    else:
                        sb.connecting.add(src)
        except MPI.Exception as exc:
            sb.error = f"a standby process died ({exc.Get_error_string()})"
            return
        if not sb.alive_on_this_host():
            sb.error = "a standby process died"

    def _send_link(self, sb: Standby, payload: dict[str, Any], tag: int) -> None:
        """A small JSON message to every process of ``sb`` that said hello (connected: the send never waits)."""
        MPI = _mpi()
        data = np.frombuffer(json.dumps(payload).encode(), dtype=np.uint8).copy()
        self._sent.append(data)  # the buffer outlives the freed requests
        for r in sorted(sb.procs):
            try:
                sb.link.Isend([data, MPI.BYTE], dest=r, tag=tag).Free()
            except MPI.Exception:
                pass  # that one is dead: tend() notices

    def _seat(self, sb: Standby, replica: int) -> None:
        """Give an idle standby the seat of a lost replica: its script starts at once, merged later (connect)."""
        layout = self.comm.layout
        ranks = tuple(layout.rank_of(replica, s) for s in range(layout.shards))
        seat_ = Seat(ranks, self.started_attempts + 1, time.time(), self._context())
        self._send_link(sb, {"seat": seat_.to_json()}, TAG_SEAT)
        self.pool.remove(sb)
        sb.replica = replica
        self.seated.append(sb)
        print(f"[lightning-recover] standby {sb.number} takes the seat of replica {replica}", file=sys.stderr, flush=True)

    def _dismiss(self, sb: Standby, reason: str) -> None:
        """Tell a standby to leave (it exits 0); one that never said hello or is not warm yet is fenced
        instead (stopped or wedged in its imports, it would never read the message)."""
        if sb.link is not None:
            self._poll_standby(sb)
            if sb.procs and sb.error is None:
                self._send_link(sb, {"quit": reason}, TAG_SEAT)
        if len(sb.procs) < self.shards or (sb.replica is None and len(sb.warm) < self.shards):
            self._fence_standby(sb, reason)

    def _fence_standby(self, sb: Standby, reason: str) -> None:
        """SIGKILL the standby's processes on this host that are still there (a stopped or wedged one too)."""
        host = host_checksum()
        for pid, start, where in sb.procs.values():
            if where == host and start >= 0:
                lifecycle.kill_process(pid, str(start), f"standby {sb.number}: {reason}", by="leader", target="standby")

