"""What a re-join does to the step's collectives: one job against 2 ranks + 2 spawned ones.

Run it as ``python -m benchmarks.mixed_world`` (about a minute on 2 cores). A replacement is
spawned into its own MPI job (``MPI_Comm_spawn``), and Open MPI carries traffic between jobs
over TCP, never shared memory. On an oversubscribed host the step's collectives are waited
for politely (:mod:`lightning_recover.comm.mpi_wait`: tests, then sleeps doubling up to a
cap), and over TCP each hop of a collective waits for its receiver's next test. This measures
the step's three kinds of collective -- the 8-float step header all-reduce, a 180 KB gradient
bucket all-reduce (the tiny model's whole gradient) and the commit agreement (``Iagree``) --
4 ranks on this host, median per rank over ``--iters`` rounds, in

* ``one job``: ``lightning-recover launch -n 4`` (shared memory), at the shared-memory cap;
* ``2 + 2 spawned``: ``launch -n 2``, whose ranks spawn one replacement, then the 3 spawn a
  fourth (two re-joins: three MPI jobs), at the shared-memory cap and at the TCP cap that
  :func:`lightning_recover.comm.mpi_wait.agree` picks for such a world.

Each launch runs in a :class:`proctree.ProcessTree` (its whole tree ended by pid before the
next). Last line: the mixed world's step collectives (header + bucket + agreement) at the
shared-memory cap over the same at the TCP cap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from benchmarks.proctree import ProcessTree, become_subreaper

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mixed_world.json"
KINDS = ("header", "bucket", "agree")


def rank_main(role: str, out: Path, iters: int, cap: float) -> None:
    """One rank: build the world (spawning as a re-join does), time each kind of collective."""
    import numpy as np
    from mpi4py import MPI

    from lightning_recover.comm import mpi_wait

    me = [sys.executable, str(Path(__file__).resolve())]
    args = ["--rank", "--out", str(out), "--iters", str(iters), "--cap", repr(cap)]
    info = MPI.Info.Create()
    info.Set("map_by", ":OVERSUBSCRIBE")  # as the recruiter spawns: the launch's slots are taken
    info.Set("bind_to", "none")

    def spawn(comm: MPI.Intracomm, role: str) -> MPI.Intracomm:
        return comm.Spawn(me[0], args=[me[1], "--role", role, *args], maxprocs=1, info=info).Merge(high=False)

    if role == "one":
        world = MPI.COMM_WORLD
    elif role == "orig":
        world = spawn(spawn(MPI.COMM_WORLD, "spawn1"), "spawn2")
    elif role == "spawn1":
        world = spawn(MPI.Comm.Get_parent().Merge(high=True), "spawn2")
    else:
        world = MPI.Comm.Get_parent().Merge(high=True)
    rows = world.allgather(mpi_wait.reach())
    mpi_wait.agree([True] * len(rows), rows)
    picked = mpi_wait.max_pause()
    mpi_wait._max_pause = cap  # the cap under test, whatever the world would pick
    header, bucket = np.ones(8, np.float32), np.ones(45_000, np.float32)
    medians: dict[str, float] = {}
    for kind in KINDS:
        times = []
        for _ in range(iters):
            time.sleep(0.002)  # the step's compute, during which the peers' messages arrive
            t0 = time.perf_counter()
            if kind == "agree":
                flag = np.array([1], dtype=np.intc)
                mpi_wait.wait(world.Iagree(flag))
            else:
                buf = header if kind == "header" else bucket
                into = np.empty_like(buf)  # held until the wait returns: MPI writes into it meanwhile
                mpi_wait.wait(world.Iallreduce(buf, into))
            times.append(time.perf_counter() - t0)
        medians[kind] = statistics.median(times)
    rows = world.gather({"medians": medians, "reaches": len(set(rows)), "picked_cap": picked}, root=0)
    if world.Get_rank() == 0:
        (out / "result.json").write_text(json.dumps(rows))
    world.Barrier()


def launch(n: int, role: str, out: Path, iters: int, cap: float, timeout: float) -> tuple[list[dict], list[str]]:
    """One launch of ``n`` ranks in ``role``; its per-rank results and what ProcessTree had to end."""
    from lightning_recover.cli.mpiexec import launch_env

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(n), "--", sys.executable,
           str(Path(__file__).resolve()), "--rank", "--role", role, "--out", str(out), "--iters", str(iters),
           "--cap", repr(cap)]
    env = launch_env()
    # Polite on any host, as on an oversubscribed one (the launch's own environment only).
    env.update({"OMP_NUM_THREADS": "1", "LIGHTNING_RECOVER_MPI_WAIT": "sleep",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    with open(out / "job.log", "wb") as sink, ProcessTree(cmd, f"mixed_world {role}", cwd=ROOT, env=env, stdout=sink,
                                                         stderr=subprocess.STDOUT) as tree:
        tree.wait(timeout)
        leftovers = tree.end()
    log = (out / "job.log").read_text(errors="replace")  # ProcessTree.end() printed any leftovers it ended
    result = out / "result.json"
    if not result.exists():
        raise RuntimeError(f"the {role} launch wrote no result; its log ends:\n{log[-2000:]}")
    return json.loads(result.read_text()), leftovers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=150, help="rounds of each collective per launch")
    p.add_argument("--timeout", type=float, default=180, help="hard limit per launch, seconds")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the measurements are written (JSON)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", default="one", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--cap", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        rank_main(args.role, args.out, args.iters, args.cap)
        return 0
    from lightning_recover.comm import mpi_wait

    become_subreaper()
    runs = [("one job", 4, "one", mpi_wait.MAX_PAUSE_S), ("2 + 2 spawned", 2, "orig", mpi_wait.MAX_PAUSE_S),
            ("2 + 2 spawned", 2, "orig", mpi_wait.MAX_PAUSE_TCP_S)]
    print(f"4 ranks on {os.cpu_count()} cores, polite waits, median per rank of {args.iters} rounds (ms; max over ranks)")
    print(f"{'world':15s} {'cap':>7s} {'picked':>7s} " + " ".join(f"{k:>7s}" for k in KINDS) + f" {'sum':>7s}")
    sums: dict[tuple[str, float], float] = {}
    table: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lr-mixed-") as tmp:
        for i, (name, n, role, cap) in enumerate(runs):
            rows, leftovers = launch(n, role, Path(tmp) / str(i), args.iters, cap, args.timeout)
            worst = {k: max(r["medians"][k] for r in rows) for k in KINDS}
            sums[(name, cap)] = sum(worst.values())
            table.append({"world": name, "cap_s": cap, "picked_cap_s": rows[0]["picked_cap"], "worst_median_s": worst,
                          "per_rank": rows, "leftovers": leftovers})
            print(f"{name:15s} {cap * 1e3:>5.2f}ms {rows[0]['picked_cap'] * 1e3:>5.2f}ms "
                  + " ".join(f"{worst[k] * 1e3:>7.2f}" for k in KINDS) + f" {sums[(name, cap)] * 1e3:>7.2f}", flush=True)
    mixed_sm, mixed_tcp = sums[("2 + 2 spawned", mpi_wait.MAX_PAUSE_S)], sums[("2 + 2 spawned", mpi_wait.MAX_PAUSE_TCP_S)]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"benchmark": "mixed_world", "iters": args.iters, "cores": os.cpu_count(),
                                        "runs": table, "ratio": mixed_sm / mixed_tcp}, indent=1))
    print(f"wrote {args.results}")
    print(f"2 + 2 spawned, step collectives at the shared-memory cap / at the TCP cap: {mixed_sm / mixed_tcp:.2f}x "
          f"({mixed_sm * 1e3:.2f} / {mixed_tcp * 1e3:.2f} ms; one job {sums[('one job', mpi_wait.MAX_PAUSE_S)] * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
