"""Entry point of a replacement rank (the launch side: it runs the user's script, so it sits above
the strategy it pre-imports): ``python -m lightning_recover.cli.joiner SEAT SCRIPT [ARGS...]``,
or of a warm standby: ``python -m lightning_recover.cli.joiner --standby SPEC SCRIPT [ARGS...]``.

The survivors spawn this (:mod:`lightning_recover.membership.recruiter`); nobody runs it by hand. It
initializes MPI and merges with the survivors first -- before the script imports torch and
Lightning, which takes seconds -- so the survivors' Spawn returns about as fast as a bare
interpreter starts and they train on while this process gets ready. Then it runs the
user's script under its original argv; the strategy finds the seat with
:func:`lightning_recover.membership.seat.seat` and joins at a step boundary.

A rank that completes a re-formed replica (salvage with re-join: its seat names the survivors'
port, :data:`~lightning_recover.membership.seat.ORPHANS_PORT`) is spawned by that replica's
orphans instead: it merges with them, and they connect to the survivors together.

A standby (see :mod:`lightning_recover.membership.standby`) merges with the leader
alone, imports the strategy and the installed packages the script imports at its top level
(:func:`installed_imports`; never the user's own modules), tells the leader it is warm and
sleeps until it gets a seat -- then it runs the script exactly as a replacement does, merged
with the survivors only once its script reached admission -- or ``quit`` (training ended).
Its start-up is bounded by ``rejoin.timeout_s`` like a replacement's; once the leader heard
that it is warm it has no timer (a job may never lose a replica): it leaves when the leader
that spawned it is gone (an MPI error on the link, or the leader's pid gone from this host;
a leader on another host that dies unreported leaves its standby waiting).

A timer bounds the whole wait: a replacement that is not admitted within the seat's
timeout (its attempt was dropped, the survivors died or finished) leaves by itself; if it
is wedged inside MPI (MPI_Init with its parents gone), SIGALRM ends it shortly after.

**The job's world.** A replacement's ``MPI.COMM_WORLD`` and the launcher's variables
(``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``) describe its *spawn*: the k processes
of its attempt. The script must see the job it joins -- a fault schedule naming rank 3 of
a 4-rank job is valid there, and ``rank0.json`` must not be written by a replacement of
rank 2 -- so before the script runs this sets ``OMPI_COMM_WORLD_SIZE`` to the job's size
and ``OMPI_COMM_WORLD_RANK`` to the logical rank taken over (:func:`job_environment`),
along with the survivors' own job settings (``LR_*``, ``LIGHTNING_RECOVER_*``, e.g. the
example's run directory stamp). Here, once, because every reader (the strategy's cluster
environment, the example's configuration and fault-schedule checks, a script's own rank
checks) reads these variables and none runs before the script; MPI read its own settings
at initialization, above, so nothing in MPI changes. ``MPI.COMM_WORLD`` itself cannot be
changed, and neither are the per-host ``OMPI_COMM_WORLD_LOCAL_*`` (they describe this
spawn's placement): ask the strategy (``strategy.world_size``) or ``OMPI_COMM_WORLD_SIZE``
for the job's size, never ``MPI.COMM_WORLD.Get_size()``.

**Leaving before admission.** A replacement whose script ends before it was admitted --
``sys.exit(3)`` from a failed check, an uncaught exception, or simply returning -- leaves
by ``SIGKILL`` after one stderr line, never by a plain exit status: Open MPI 5.0.11 does not
reliably tell the survivors about a spawned process that exited with a non-zero status (of
two in one attempt, only one ever reached them; see also :mod:`lightning_recover.runtime.lifecycle`),
while a killed one is an ordinary process failure,
and the survivors drop the attempt at their next step boundary instead of after
``rejoin.timeout_s``. (The survivors never wait on an unreported death either; this only
makes the drop prompt.) After admission the script's exit is the script's.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import json
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_recover.membership import handshake, milestones
from lightning_recover.membership.admission_timer import disarm, is_admitted, leave_after
from lightning_recover.membership.replacement import job_environment, left_before_admission, run_seat
from lightning_recover.membership.seat import ORPHANS_PORT, Seat
from lightning_recover.runtime import lifecycle, priority


def _warm_up(script: str) -> list[str]:
    """What a standby does before it sleeps: import the strategy (torch, Lightning) and the installed
    packages the script imports at its top level (:func:`installed_imports`), so that the script,
    once seated, finds them loaded. Nothing of the user's own code runs before the seat is known.
    Returns the modules imported; one that fails to import is left to the script."""
    import lightning_recover.strategies  # noqa: F401

    done = ["lightning_recover.strategies"]
    for name in installed_imports(script):
        try:
            importlib.import_module(name)
        except Exception:  # the script will raise it itself, with its own context
            continue
        done.append(name)
    return done


def _under(path: Path, directories: set[Path]) -> bool:
    return any(d == path.parent or d in path.parents for d in directories)


def installed_imports(script: str) -> list[str]:
    """The modules ``script`` imports at its top level that are installed packages (found outside the
    script's directory and the working directory), in order; relative imports and the user's own
    modules are left out, since importing them may run the user's code."""
    try:
        tree = ast.parse(Path(script).read_text(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    own = {Path(script).resolve().parent, Path.cwd().resolve()}
    # A virtual environment inside the project (./.venv) is still installed packages, not the user's code.
    installed = {Path(p).resolve() for k, p in sysconfig.get_paths().items() if k in ("purelib", "platlib", "stdlib", "platstdlib")}
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    out: list[str] = []
    for name in names:
        top = name.split(".")[0]
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) if spec is not None else None
        if origin is None or origin in ("built-in", "frozen"):
            continue
        path = Path(origin).resolve()
        if _under(path, own) and not _under(path, installed) and top != "lightning_recover":
            continue  # the user's own module (next to the script or in the working directory)
        if name not in out:
            out.append(name)
    return out


def _leader_alive(spec: dict[str, object]) -> Callable[[], bool]:
    """Whether the leader that spawned this standby still runs (checked by pid on its host; elsewhere
    an MPI error on the link tells)."""
    pid, start, host = spec.get("leader_pid"), spec.get("leader_start"), spec.get("leader_host")
    if not isinstance(pid, int) or host != handshake.host_checksum():
        return lambda: True
    return lambda: lifecycle.process_start_time(pid) == start


def standby(spec_json: str, script_argv: list[str]) -> None:
    """A warm standby: merge with the leader, import, say WARM, then sleep until a seat (or ``quit``)."""
    milestones.mark("python")
    try:
        spec = dict(json.loads(spec_json))
        milestones._marks["spawned"] = float(spec["spawned_at"])
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"lightning_recover.cli.joiner --standby: {spec_json!r} is not the leader's JSON spec") from None
    timeout_s = float(spec.get("timeout_s", 120.0))
    # Bounded until the leader has heard that it is warm: a standby whose leader ended meanwhile
    # (training finished while it started) must not wait in MPI's start-up or a send forever.
    leave_after(timeout_s, f"standby {spec.get('number')}")
    link = _merge_with_parent("lightning_recover.cli.joiner --standby runs only as a spawned standby")
    alive = _leader_alive(spec)
    handshake.leader_alive = alive
    # A quarter of its time to be warm at idle priority leaves the rest for the fallback's share.
    restore = priority.yield_while_warming(timeout_s / 4) if spec.get("yield_cpu") else (lambda: None)
    _warm_up(script_argv[0])
    milestones.mark("warm")
    if not handshake.tell_leader(link, handshake.TAG_WARM):
        os._exit(0)  # the leader is gone
    disarm()  # from here on it waits as long as the job may run; its leader's end ends it
    msg = handshake.wait_on_link(link, alive)
    if msg is None or "seat" not in msg:
        os._exit(0)  # dismissed (training ended) or the leader is gone: nothing to leave behind
    restore()  # from here on it is a training rank's start-up: its full share of the cores
    milestones.mark("seated")
    seat = Seat.from_json(str(msg["seat"]))
    leave_after(float(seat.context.get("timeout_s", 120.0)), f"standby {spec.get('number')}")
    run_seat(seat, None, script_argv, link=link)


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[0] == "--standby":
        standby(argv[1], argv[2:])
        return
    if len(argv) < 2:
        raise SystemExit("usage: python -m lightning_recover.cli.joiner [--standby SPEC | SEAT] SCRIPT [ARGS...] (spawned by lightning-recover)")
    milestones.mark("python")
    seat = Seat.from_json(argv[0])
    timeout = float(seat.context.get("timeout_s", 120.0))
    leave_after(timeout, f"of attempt {seat.attempt}")
    port = seat.context.get(ORPHANS_PORT)
    if not isinstance(port, str):
        run_seat(seat, _merge_with_parent("lightning_recover.cli.joiner runs only as a spawned replacement"), argv[1:])
        return
    # Spawned by the orphans of a re-formed replica (salvage): merged with them first, this process
    # reaches the survivors together with them, and the replica's own ranks are that first merge.
    from mpi4py import MPI

    team = _merge_with_parent("lightning_recover.cli.joiner runs only as a spawned replacement", hello=False)
    try:
        merged = team.Connect(port, root=0).Merge(high=True)
    except MPI.Exception as exc:
        left_before_admission(seat.ranks[team.Get_rank()], f"its re-formed replica could not reach the survivors ({exc.Get_error_string()})")
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    handshake.say_hello(merged)
    run_seat(seat, merged, argv[1:], children=team)


def _merge_with_parent(refusal: str, *, hello: bool = True) -> Any:
    """Start MPI, merge with the ranks that spawned this process (placed after them) and say hello to
    the merged communicator's rank 0 (``hello``: it is the survivors' leader)."""
    lifecycle.prepare_mpi()
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise SystemExit(f"{refusal} (no parent communicator)")
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    if hello:
        handshake.say_hello(merged)
    milestones.mark("merged")
    # Nobody sends on COMM_SELF: the probe only enters MPI's progress engine.
    probe = functools.partial(MPI.COMM_SELF.Iprobe, MPI.ANY_SOURCE, MPI.ANY_TAG)
    threading.Thread(target=_keep_alive, args=(probe,), name="lightning-recover-keep-alive", daemon=True).start()
    return merged


#: How often a replacement that is not yet admitted enters MPI's progress engine (seconds).
KEEP_ALIVE_S = 0.25


def _keep_alive(probe: Callable[[], object]) -> None:
    """Enter MPI's progress engine every :data:`KEEP_ALIVE_S` until admitted. This process imports torch
    and Lightning and runs the script's set-up for seconds after MPI started, without an MPI call;
    Open MPI's heartbeat detector without its thread (on fake hosts, or ``--mpi-detector``) sends
    heartbeats only from inside MPI calls, so a replacement would be declared dead (and aborted by
    Open MPI) while it imports. Once admitted, training's collectives make the progress."""
    while not is_admitted():
        try:
            probe()
        except Exception:  # MPI is being torn down as this process leaves: nothing to keep alive
            return
        time.sleep(KEEP_ALIVE_S)


if __name__ == "__main__":
    main(sys.argv[1:])
