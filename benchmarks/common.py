"""What the benchmarks share to launch a measured job and to judge the machine it ran on.

Role: every measuring benchmark (overhead, goodput, rejoin, sdc_overhead, scaling, peers,
step_cost) times jobs on a machine it may share with other work, so each launch must be
made the same way and its numbers read against the same yardsticks:

* :func:`launch` runs one job of ``bench_job.py`` (``lightning-recover launch``, or plain
  ``mpiexec`` without fault tolerance) under a hard timeout and ends its whole process
  tree (:class:`proctree.ProcessTree`) before returning, with its wall time, its CPU time
  and how many cores other work used meanwhile;
* :func:`wait_quiet` waits (bounded) for other work on the machine to stop before a timed
  job, :func:`loadavg`, :func:`proc_stat` and :func:`children_cpu` read the machine's load;
* :func:`read_clock` reads the step clock a job's rank 0 wrote, :func:`bootstrap_ratio`
  gives the 95% interval of a ratio of median step times.

It is a module of the checkout's ``benchmarks`` package (``python -m benchmarks.NAME`` from the
repository root), not of the installed package.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from benchmarks.proctree import ProcessTree

ROOT = Path(__file__).resolve().parents[1]
#: The launched training job :func:`launch` runs.
JOB = ROOT / "benchmarks" / "bench_job.py"


def proc_stat() -> tuple[int, int] | None:
    """(total, busy) jiffies of the whole machine from /proc/stat, or None.

    Niced time counts as busy: with the kernel's autogroup scheduling (the default on
    desktop/server kernels) a nice-19 job in another session still gets its group's full
    share of the CPU.
    """
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    vals = vals[:8]  # user nice system idle iowait irq softirq steal (guest time is inside user/nice)
    total = sum(vals)
    return total, total - vals[3] - (vals[4] if len(vals) > 4 else 0)


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children: a launched job's own CPU time, by difference."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_quiet(max_wait: float, cores: float = 0.5) -> tuple[float, float | None]:
    """Wait (at most ``max_wait`` s) until other work on the machine uses under ``cores`` cores.

    The machine is shared; starting a timed job while another job is running only adds
    noise. Returns (seconds waited, cores busy at the last sample).
    """
    t0 = time.time()
    busy = None
    while True:
        a = proc_stat()
        time.sleep(1.0)
        b = proc_stat()
        if a is None or b is None:
            return time.time() - t0, None
        busy = (b[1] - a[1]) / max(1, b[0] - a[0]) * (os.cpu_count() or 1)
        if busy < cores or time.time() - t0 >= max_wait:
            return time.time() - t0, busy


def launch(job_args: list[str], outdir: Path, timeout: float, *, ft: bool = True, nprocs: int = 4) -> dict:
    """Run one 4-rank job of bench_job.py under a hard timeout, then end its whole process tree.

    Every process the launch started is gone when this returns (see ``proctree.py``); the
    ones that outlived mpiexec or the timeout are printed and returned as ``leftovers``.

    ``ft=True``: ``lightning-recover launch`` (mpiexec --with-ft ulfm). ``ft=False``: plain
    ``mpiexec`` without fault tolerance, so one rank's death aborts the whole job.
    """
    from lightning_recover.cli.mpiexec import build_command, launch_env

    outdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(JOB), *job_args, "--out", str(outdir)]
    if ft:
        cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(nprocs), "--", *command]
    else:
        cmd = [c for c in build_command(nprocs, command) if c not in ("--with-ft", "ulfm")]
    env = launch_env()
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
                "PYTHONWARNINGS": "ignore"})
    stat0, cpu0 = proc_stat(), children_cpu()
    t0 = time.time()
    # ProcessTree: mpiexec's ranks sit in their own process groups, so ending mpiexec's group
    # is not enough; the tree (session + every descendant seen) is ended by pid, also on
    # exceptions, and any rank that outlived mpiexec is reported.
    with ProcessTree(cmd, f"{outdir.name} job", cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as tree:
        proc = tree.proc
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()  # drains the pipe so the job never blocks on a full one while we poll
        timed_out = tree.wait(timeout) is None
        leftovers = tree.end()
        reader.join(timeout=10)
        log = b"".join(chunks).decode(errors="replace")
    wall = time.time() - t0
    stat1, cpu1 = proc_stat(), children_cpu()
    # CPU the rest of the machine used meanwhile, in cores: (all busy time - this job's CPU time) / wall.
    foreign = None
    if stat0 is not None and stat1 is not None:
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        foreign = max(0.0, ((stat1[1] - stat0[1]) / hz - (cpu1 - cpu0)) / max(wall, 1e-9))
    (outdir / "job.log").write_text(log or "")
    return {"rc": proc.returncode, "timed_out": timed_out, "wall_s": wall, "t0": t0, "job_cpu_s": cpu1 - cpu0,
            "foreign_cores": foreign, "log_tail": (log or "")[-3000:],
            "leftovers": leftovers}


def read_clock(path: Path) -> dict | None:
    """The step clock a job's rank 0 wrote (``clock.json`` of bench_job.py), or None if it wrote none or a torn one."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def bootstrap_ratio(a: list[float], b: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of median(a) / median(b)."""
    rng = random.Random(seed)
    rs = []
    for _ in range(n):
        ra = statistics.median(rng.choices(a, k=len(a)))
        rb = statistics.median(rng.choices(b, k=len(b)))
        rs.append(ra / rb)
    rs.sort()
    return rs[int(0.025 * n)], rs[int(0.975 * n) - 1]


def loadavg() -> float | None:
    """The machine's 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
