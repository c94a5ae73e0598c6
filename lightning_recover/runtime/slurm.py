"""What this process can tell about Slurm from its environment: the allocation it runs in, and
whether Slurm (not ``mpiexec``) started it.

The supported way to run under Slurm is ``lightning-recover launch`` inside an allocation
(``sbatch``/``salloc``): ``mpiexec --with-ft ulfm`` starts the ranks. A direct ``srun`` start
does not work with ULFM (tried on Slurm 22.05: ranks fail inside ``MPI_Init``, or slurmstepd
kills the whole step after the first failure; Open MPI supports fault tolerance under its
own runtime only), and without an MPI world each task would train alone as a single
replica -- N copies of the job writing one run directory. :func:`refuse_direct_launch` stops
such a start on every task with one line naming the fix, before MPI initializes (a direct
start can crash inside ``MPI_Init``) and before anything is written.

Pure standard library (the launcher and the example's entry point use it before heavy imports).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence

#: The exit status of a refused direct start (a usage error).
REFUSED_STATUS = 2
#: Variables Open MPI's runtime (mpiexec / prterun, also when PRRTE started its daemons through
#: srun on a multi-node allocation) puts into every process it launches; Slurm never sets them.
_MPIEXEC_VARS = ("OMPI_COMM_WORLD_RANK", "PRTE_LAUNCHED")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def started_by_srun(env: Mapping[str, str] | None = None) -> bool:
    """Whether Slurm started this process as one of several tasks of a job step (``srun -n N``, N > 1)
    and Open MPI's runtime did not.

    A step's tasks carry ``SLURM_STEP_ID`` (the batch script and an ``salloc`` shell do not,
    though every process they start inherits ``SLURM_PROCID=0``); processes launched by
    ``mpiexec`` carry ``OMPI_COMM_WORLD_RANK`` / ``PRTE_LAUNCHED`` even when they inherit a
    step's variables. A one-task step (``srun --pty bash``, ``srun -n 1 python ...``) is one
    process, as plain ``python`` is, and is let through.
    """
    e = _env(env)
    if "SLURM_STEP_ID" not in e or any(v in e for v in _MPIEXEC_VARS):
        return False
    tasks = e.get("SLURM_STEP_NUM_TASKS") or e.get("SLURM_NTASKS") or "1"
    return tasks.isdigit() and int(tasks) > 1


def refusal_line(env: Mapping[str, str] | None = None, script: str | None = None) -> str:
    """The one line a refused direct start prints (see the module docstring)."""
    e = _env(env)
    tasks = e.get("SLURM_STEP_NUM_TASKS") or e.get("SLURM_NTASKS") or "N"
    if script is None:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    return (
        f"[lightning-recover] error: task {e.get('SLURM_PROCID', '?')} of {tasks} was started by srun, not by mpiexec: "
        "fault tolerance (ULFM) works only under Open MPI's own runtime, and each task would train alone; "
        f"inside sbatch/salloc run: lightning-recover launch -- python {script} ... (see examples/slurm/train.sbatch)"
    )


def refuse_direct_launch(env: Mapping[str, str] | None = None) -> None:
    """Exit with :data:`REFUSED_STATUS` and one line on stderr when Slurm started this process directly
    (:func:`started_by_srun`); otherwise return. Call before MPI is initialized."""
    if not started_by_srun(env):
        return
    print(refusal_line(env), file=sys.stderr, flush=True)
    # os._exit: no exit handlers or Lightning teardown may run (nor write) in a process that must not exist.
    os._exit(REFUSED_STATUS)


#: What ``lightning-recover launch`` passes to mpiexec inside an allocation: Open MPI's Slurm launcher
#: starts its daemons on the other nodes with one ``srun`` step, and a step that lost a node stays
#: RUNNING, holding its CPUs on the nodes left, until Slurm has marked the node DOWN and killed it;
#: without ``--overlap`` the relaunch's daemon step waited behind it (for good, on Slurm 22.05 here).
DAEMON_STEP_ARGS = ("--prtemca", "plm_slurm_args", "--overlap")


def daemon_step_args(extra: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """:data:`DAEMON_STEP_ARGS` inside an allocation (``SLURM_JOB_ID``), unless the user set
    ``plm_slurm_args`` (in ``extra`` or as ``PRTE_MCA_plm_slurm_args``); else nothing."""
    e = _env(env)
    if "SLURM_JOB_ID" not in e or "plm_slurm_args" in extra or "PRTE_MCA_plm_slurm_args" in e:
        return []
    return list(DAEMON_STEP_ARGS)


def allocation_tasks(env: Mapping[str, str] | None = None) -> int | None:
    """The task count of the allocation this process runs in (``SLURM_NTASKS``), or None outside one."""
    e = _env(env)
    value = e.get("SLURM_NTASKS") or e.get("SLURM_NPROCS")
    if value is None or "SLURM_JOB_ID" not in e:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"SLURM_NTASKS={value!r} is not a positive task count; give -n N explicitly")
    return int(value)


def tasks_outnumber_cpus(env: Mapping[str, str] | None = None) -> bool:
    """Whether some node of the allocation has more tasks (``SLURM_TASKS_PER_NODE``) than CPUs
    (``SLURM_JOB_CPUS_PER_NODE``): ``sbatch -O``/``--overcommit``, where Open MPI's default
    binding to cores fails ("binding more cpus than are available") and ranks must run unbound."""
    e = _env(env)
    tasks, cpus = e.get("SLURM_TASKS_PER_NODE"), e.get("SLURM_JOB_CPUS_PER_NODE")
    if not tasks or not cpus:
        return False
    per_task, per_cpu = _expand(tasks), _expand(cpus)
    if len(per_task) != len(per_cpu):
        raise ValueError(
            f"SLURM_TASKS_PER_NODE={tasks!r} and SLURM_JOB_CPUS_PER_NODE={cpus!r} name different node counts; give --hosts explicitly"
        )
    return any(t > c for t, c in zip(per_task, per_cpu))


def _expand(spec: str) -> list[int]:
    """Slurm's compressed per-node counts, ``"4(x2),2"`` -> ``[4, 4, 2]`` (the node count read from the spec itself)."""
    nodes = sum(int(m.group(2) or 1) for m in re.finditer(r"(\d+)(?:\(x(\d+)\))?", spec))
    return parse_slurm_counts(spec, nodes)


def parse_slurm_counts(spec: str, nodes: int) -> list[int]:
    """Slurm's compressed per-node counts (``SLURM_TASKS_PER_NODE``): ``"4(x2),2"`` -> ``[4, 4, 2]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"Slurm per-node count {spec!r} is not like '4(x2),2'; set --hosts explicitly")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(counts) != nodes:
        raise ValueError(f"Slurm per-node count {spec!r} gives {len(counts)} node(s) but the allocation has {nodes}; set --hosts explicitly")
    return counts
