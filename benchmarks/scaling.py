"""How recovery cost grows with the job: layer 1 at 4-64 ranks, the policy at 10^3-10^5 replicas, the ledger line.

Run it as ``python -m benchmarks.scaling`` (the full curve, 4 8 16 32 64 ranks: 5-6
minutes on a 2-core machine; docs/benchmarks.md's ``--repeats 2 --faults 5`` about 11) or
``--quick`` (4 and 8 ranks, small planning sizes: a smoke test). Three parts, each
printed as a table with its fitted growth:

1. **Layer 1 under real process death.** For each N in ``--ranks`` one job of
   ``benchmarks/scaling_rank.py`` is launched with the project's launcher (``python -m
   lightning_recover.cli launch -n N``: ``mpiexec --with-ft ulfm``, ``--oversubscribe`` past
   the cores), inside a :class:`proctree.ProcessTree` under a hard timeout, so the job's
   whole process tree is ended by pid before the next launch, also on a timeout; what had
   to be ended is printed. Every rank is one replica of a
   :class:`~lightning_recover.comm.communicator.FaultTolerantComm` reducing a tiny buffer
   (``--numel`` fp32 in ``--bucket-bytes`` buckets) and nothing else (no model, no
   Lightning). ``--faults`` ranks (never the leader) are SIGKILLed one after the other, each
   by itself with ``os.kill`` in the middle of a step's bucketed reduction; the survivors
   stamp ``time.monotonic()`` (one clock for every process of the machine) at each phase
   of the recovery (see ``scaling_rank.py``). Per fault, a phase's time runs from the
   previous phase's end *on the last survivor to get there* to its own end on the last
   survivor (so the times add up to the recovery):

   * ``detect``: SIGKILL -> every survivor got ``PeerFailure`` from the reduction;
   * ``agree``: -> every survivor's ``agree(False)`` returned (ULFM ``MPI_Comm_agree``);
   * ``shrink``: -> ``MPI_Comm_shrink`` returned everywhere (``repair()``'s ``repair:shrunk`` point);
   * ``rebuild``: -> ``repair()`` returned everywhere (splits, agreement on the new world,
     quorum, fencing, the new data plane);
   * ``rereduce``: -> the stale and pending buckets were reduced in the new world;
   * ``commit``: -> the step's commit agreement returned True everywhere;
   * ``recovery``: SIGKILL -> committed everywhere (the sum of the above).

   The value per N is the median over its faults (``--repeats`` jobs per N pool theirs). The ranks wait politely
   (:mod:`lightning_recover.comm.mpi_wait`: an oversubscribed host's reductions sleep instead of
   spinning), but ULFM's agreement and shrink are blocking MPI calls that poll: with 32 or
   64 ranks on 2 cores their time is mostly the scheduler's, and the curve measures this
   machine, not a cluster with a core per rank.

2. **The policy's planning time** (pure: :class:`lightning_recover.workload.static_world.StaticWorld`, no
   MPI) at ``--plan-replicas`` W (10^3-10^5), G_init = 2, T = W (no spares, so a loss is a
   boundary step that replays its ids over every survivor, the policy's costliest path):
   ``begin_step`` over W live replicas, ``fail`` of one contributor, ``commit``; the median of
   ``--plan-reps`` fresh policies. Every rank of every replica runs this plan each step.

3. **The ledger line at B = ``--ledger-B``** (8192): the JSON line the leader appends per
   committed step (:class:`lightning_recover.audit.ledger_writer.LedgerWriter`, one fsync'ed write),
   built as the step engine builds it (the policy's commit record plus the engine's
   fields), fault-free and with one fault, for several W x G = B; bytes and write time.

Growth is fitted per quantity by least squares on the per-size medians: ``t = a * n^k``
(log-log; ``k`` printed) and ``t = a + b * log2 n`` (``b`` printed). Results go to
``benchmarks/results/scaling.json``; the last line printed is the headline
``recovery time 4 -> 64 ranks: x.xx s -> y.yy s, growth ~ n^k; ...``.

Torch in the ranks: issue 23 asks for layer 1 without torch. Importing
``lightning_recover.comm.communicator`` and building the communicator on the MPI plane load
none (each rank records it, the last lines say so); the ranks import torch afterwards only
for the tensors they reduce (``FaultTolerantComm.allreduce`` takes torch tensors: ~1.4 s CPU
and ~150 MiB private memory each here). The table's start-up and peak RSS include that
import; the start-up line shows it apart, and the JSON records it per rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RANK = ROOT / "benchmarks" / "scaling_rank.py"
from benchmarks.common import loadavg, wait_quiet  # noqa: E402
from benchmarks.proctree import ProcessTree, become_subreaper  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "scaling.json"
#: Phases of one recovery, in order; each is timed from the previous one's end on the last survivor.
PHASES: tuple[str, ...] = ("detect", "agree", "shrink", "rebuild", "rereduce", "commit")
#: The stamp each phase ends at (scaling_rank.py's names).
PHASE_END = {"detect": "detect", "agree": "agree", "shrink": "shrunk", "rebuild": "repaired", "rereduce": "rereduced", "commit": "committed"}
QUICK = {"ranks": [4, 8], "plan_replicas": [100, 1000], "plan_reps": 3, "faults": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: ranks 4 8, 2 faults, planning at 100 and 1000 replicas")
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="world sizes (one launched job each)")
    p.add_argument("--faults", type=int, default=3, help="ranks SIGKILLed per job, one per step (at most N - 2)")
    p.add_argument("--repeats", type=int, default=1, help="jobs per world size; their faults are pooled")
    p.add_argument("--numel", type=int, default=256, help="fp32 elements reduced per step (tiny: layer 1's own cost)")
    p.add_argument("--bucket-bytes", type=int, default=256, help="bucket size of the communicator (4 buckets by default)")
    p.add_argument("--kill-at-bucket", type=int, default=2, help="the victim dies before this bucket (the ones before are stale)")
    p.add_argument("--pre-kill", type=float, default=0.5, help="seconds the victim waits in the step before its SIGKILL")
    p.add_argument("--timeout", type=float, default=None, help="hard timeout per job in seconds (default 120 + 8 s per rank)")
    p.add_argument("--quiet-wait", type=float, default=5.0, help="before each job wait up to this long for other work to stop")
    p.add_argument("--plan-replicas", type=int, nargs="+", default=[1000, 10000, 100000], help="W for the planning times")
    p.add_argument("--plan-reps", type=int, default=5, help="fresh policies timed per W (median)")
    p.add_argument("--ledger-B", type=int, default=8192, help="B for the ledger line size")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON results file")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if p.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    if min(args.ranks) < 3:
        p.error("--ranks: every job needs at least 3 ranks (one is killed, two must survive)")
    if args.faults < 1 or args.repeats < 1:
        p.error("--faults and --repeats must be >= 1")
    return args


# ---------------------------------------------------------------------------------- fitting
def fit_power(ns: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = a * n^k`` on log-log; returns (a, k). Needs two distinct n and t > 0."""
    xs = [math.log(n) for n in ns]
    ys = [math.log(max(t, 1e-9)) for t in ts]
    k, log_a = _line(xs, ys)
    return math.exp(log_a), k


def fit_log2(ns: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = a + b * log2 n``; returns (a, b)."""
    b, a = _line([math.log2(n) for n in ns], list(ts))
    return a, b


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (xs, ys)."""
    if len(set(xs)) < 2:
        raise ValueError(f"a fit needs at least two distinct sizes, got {sorted(set(xs))}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def growth(ns: Sequence[float], ts: Sequence[float]) -> dict[str, float]:
    """Both fits of one quantity, as stored in the JSON."""
    a, k = fit_power(ns, ts)
    a2, b = fit_log2(ns, ts)
    return {"power_a": a, "power_k": k, "log2_a": a2, "log2_b": b}


# ---------------------------------------------------------------------------------- layer 1
def victims_for(n: int, faults: int) -> list[int]:
    """``faults`` distinct non-leader ranks spread over the world (the highest first), at most n - 2."""
    count = min(faults, n - 2)
    picks: list[int] = []
    for i in range(count):
        r = n - 1 - (i * (n - 1)) // count
        while r in picks or r == 0:  # keep them distinct and never the leader
            r = r - 1 if r > 1 else n - 1
        picks.append(r)
    return picks


def run_job(n: int, args: argparse.Namespace, outdir: Path) -> dict[str, Any]:
    """Launch one N-rank job of scaling_rank.py; its whole process tree is gone when this returns."""
    outdir.mkdir(parents=True, exist_ok=True)
    from lightning_recover.cli.mpiexec import launch_env

    victims = victims_for(n, args.faults)
    # 64 ranks importing torch (for their tensors) on 2 busy cores took 2-5 minutes to start here
    timeout = args.timeout if args.timeout is not None else 120 + 8 * n
    cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(n), "--",
           sys.executable, str(RANK), "--out", str(outdir), "--victims", ",".join(map(str, victims)),
           "--numel", str(args.numel), "--bucket-bytes", str(args.bucket_bytes),
           "--kill-at-bucket", str(args.kill_at_bucket), "--pre-kill", str(args.pre_kill),
           "--t-launch", repr(time.monotonic())]
    env = launch_env()
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    waited, busy = wait_quiet(args.quiet_wait)
    t0 = time.monotonic()
    # ProcessTree: mpiexec's ranks sit in process groups of their own, so the tree is ended by
    # pid (also on a timeout or an exception) and a rank that outlived mpiexec is reported.
    with ProcessTree(cmd, f"scaling {n} ranks", cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as tree:
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.append(tree.proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()  # drain the pipe so the job never blocks on a full one
        rc = tree.wait(timeout)
        t_end = time.monotonic()
        leftovers = tree.end()
        reader.join(timeout=10)
    log = b"".join(chunks).decode(errors="replace")
    (outdir / "job.log").write_text(log)
    return {"ranks": n, "victims": victims, "rc": rc, "timed_out": rc is None, "timeout_s": timeout, "t_end": t_end,
            "wall_s": time.monotonic() - t0, "leftovers": leftovers, "quiet_wait_s": waited,
            "busy_cores_before": busy, "loadavg_after": loadavg(), "log_tail": log[-3000:]}


def analyse_job(job: dict[str, Any], outdir: Path) -> dict[str, Any]:
    """Per-fault phase times from the ranks' stamps; raises when the job did not measure every fault."""
    ranks = [json.loads(f.read_text()) for f in sorted(outdir.glob("rank*.json"))]
    kills = {int(f.stem[4:]): json.loads(f.read_text()) for f in outdir.glob("kill*.json")}
    n, victims = job["ranks"], job["victims"]
    survivors = n - len(victims)
    if len(ranks) != survivors or len(kills) != len(victims):
        raise RuntimeError(
            f"the {n}-rank job did not finish its {len(victims)} faults "
            f"(rc={job['rc']}, timed out={job['timed_out']} after {job['timeout_s']:g} s, {len(ranks)} of {survivors} "
            f"survivors reported, {len(kills)} kills recorded); log tail:\n{job['log_tail']}"
        )
    if job["timed_out"]:
        # Every fault was measured and every survivor wrote its stamps: only the job's end was cut short.
        print(f"[scaling] note: the {n}-rank job hit its {job['timeout_s']:g} s timeout after every survivor had "
              f"reported; its measurements are kept", flush=True)
    faults = []
    for k, victim in enumerate(victims):
        rows = [r["faults"][k] for r in ranks]
        bad = [r["rank"] for r in ranks if not (r["faults"][k]["exact"] and r["faults"][k]["committed"] and r["faults"][k]["agreed_false"])]
        if bad:
            raise RuntimeError(f"{n} ranks, fault {k}: ranks {bad} did not recover exactly (wrong sums or no commit)")
        start = kills[k]["t_kill"]
        ends = {p: max(row["stamps"][PHASE_END[p]] for row in rows) for p in PHASES}
        times, prev = {}, start
        for p in PHASES:
            times[p] = ends[p] - prev
            prev = ends[p]
        times["recovery"] = ends["commit"] - start
        faults.append({"fault": k, "victim": victim, "world_before": n - k, "times_s": times,
                       "buckets_redone": rows[0]["buckets_redone"], "buckets_stale": rows[0]["buckets_stale"],
                       "repair_rounds": max(row["repair_rounds"] or 0 for row in rows),
                       "detected_in": sorted({row["detected_in"] for row in rows})})
    ready = [r["t_ready"] for r in ranks]
    return {
        "ranks": n,
        "faults": faults,
        # first rank process started -> last survivor's communicator up (the launch itself comes before)
        "startup_s": max(ready) - min(r["t_process"] for r in ranks),
        # where a rank's start-up goes, slowest rank: MPI_Init, importing the communicator, building it,
        # importing torch for the rank's tensors
        # (after a polite barrier that waits for the slowest importer: not counted in any of the three)
        "mpi_init_s_max": max(r["mpi_init_s"] for r in ranks),
        "import_comm_s_max": max(r["import_comm_s"] for r in ranks),
        "comm_init_s_max": max(r["comm_init_s"] for r in ranks),
        "import_torch_s_max": max(r["import_torch_s"] for r in ranks),
        "peak_rss_mib_max": max(r["peak_rss_mib"] for r in ranks),
        "peak_rss_mib_sum": sum(r["peak_rss_mib"] for r in ranks),
        "torch_loaded": all(r["torch_loaded"] for r in ranks),
        "torch_loaded_by_comm": any(r["torch_loaded_by_comm"] for r in ranks),
        "polite_wait": all(r["polite_wait"] for r in ranks),
        # last survivor's results written -> the launch returned (the end of job: agreement, exit)
        "end_s": job["t_end"] - max(r["t_done"] for r in ranks),
        "timed_out": job["timed_out"],
    }


def pool(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One world size's jobs as one point: their faults pooled, the medians over them, the slowest start-up."""
    faults = [f for pt in points for f in pt["faults"]]
    out = dict(max(points, key=lambda pt: pt["startup_s"]))
    out.update(faults=faults, jobs=len(points), timed_out=any(pt["timed_out"] for pt in points),
               median_s={q: statistics.median(f["times_s"][q] for f in faults) for q in (*PHASES, "recovery")},
               max_s={q: max(f["times_s"][q] for f in faults) for q in (*PHASES, "recovery")})
    return out


# ---------------------------------------------------------------------------------- policy
def time_planning(W: int, reps: int, G_init: int = 2) -> dict[str, Any]:
    """Median seconds of one faulty step's planning at W replicas (see the module docstring)."""
    from lightning_recover.workload.static_world import StaticWorld

    rows: list[dict[str, float]] = []
    for _ in range(reps):
        policy = StaticWorld(W, G_init)  # T = W: no spares, a loss is a boundary step
        alive = range(W)
        t0 = time.perf_counter()
        policy.begin_step(0, alive)
        t1 = time.perf_counter()
        plan = policy.fail([W // 2])
        t2 = time.perf_counter()
        record = policy.commit()
        t3 = time.perf_counter()
        if record.committed != policy.B or len(plan.replayed) != G_init:
            raise RuntimeError(f"W={W}: the plan did not replay the lost ids exactly once; a bug in the policy")
        rows.append({"begin_step": t1 - t0, "fail": t2 - t1, "commit": t3 - t2, "step": t3 - t0})
    return {"W": W, "G_init": G_init, "B": W * G_init, "reps": reps,
            **{k: statistics.median(r[k] for r in rows) for k in ("begin_step", "fail", "commit", "step")}}


# ---------------------------------------------------------------------------------- ledger
def ledger_line(B: int, W: int, fault: bool, path: Path) -> dict[str, Any]:
    """Bytes and write time of one ledger line at B = W * G (fault: one contributor lost in the step)."""
    from lightning_recover.audit.ledger_writer import LedgerWriter
    from lightning_recover.workload.static_world import StaticWorld

    if B % W:
        raise ValueError(f"B={B} must be a multiple of W={W}")
    policy = StaticWorld(W, B // W)
    policy.begin_step(0, range(W))
    if fault:
        policy.fail([W // 2])
    plan = policy.current_plan
    record = policy.commit().as_dict()
    # The fields StepEngine.finish adds (lightning_recover/recovery/engine.py), with typical values.
    record.update(loss=2.718281828459045, world_epoch=1 if fault else 0, step_time_s=0.123456789,
                  recovery_s=0.0123456789 if fault else 0.0, pauses_s=[0.0123456789] if fault else [],
                  detect_s=0.00123456789 if fault else 0.0, detects_s=[0.00123456789] if fault else [],
                  stale_buckets=2 if fault else 0, overlapped=False, policy=policy.name, divisor=plan.divisor, joins=[])
    path.unlink(missing_ok=True)
    with LedgerWriter(path) as writer:
        t0 = time.perf_counter()
        writer.write(record)
        write_s = time.perf_counter() - t0
    line = path.read_bytes()
    # The compact line (issue 33): the ids as ranges, the membership once per change, the roles a loss changed.
    ids = len(json.dumps(record["ids"]))
    roles = len(json.dumps({k: record[k] for k in ("members", "role_changes", "died") if k in record}))
    return {"B": B, "W": W, "G": B // W, "fault": fault, "bytes": len(line), "microbatch_ids_bytes": ids,
            "roles_bytes": roles, "write_s": write_s}


# ---------------------------------------------------------------------------------- driver
def fmt_s(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def print_growth(name: str, ns: Sequence[float], ts: Sequence[float], unit: str = "n") -> dict[str, float]:
    g = growth(ns, ts)
    print(f"  {name:<10} t ~ {g['power_a']:.3g} * {unit}^{g['power_k']:.2f}   |   t ~ {g['log2_a']:.3g} + {g['log2_b']:.3g} * log2 {unit}")
    return g


def layer1(args: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    curve: list[dict[str, Any]] = []
    failed: dict[int, str] = {}
    for n in args.ranks:
        points = []
        for rep in range(args.repeats):
            outdir = tmp / f"ranks{n}-{rep}"
            job = run_job(n, args, outdir)
            jobs.append({k: v for k, v in job.items() if k != "log_tail"})
            try:
                point = analyse_job(job, outdir)
            except RuntimeError as exc:
                failed[n] = str(exc)
                print(f"[scaling] {n} ranks FAILED: {exc}", flush=True)
                break
            points.append(point)
            print(f"[scaling] {n} ranks, job {rep + 1}/{args.repeats}: recovery "
                  f"{fmt_s(statistics.median(f['times_s']['recovery'] for f in point['faults']))} "
                  f"(median of {len(point['faults'])} faults), start-up {point['startup_s']:.1f} s, job {job['wall_s']:.1f} s",
                  flush=True)
        if n not in failed:
            curve.append(pool(points))
    return jobs, curve, failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    become_subreaper()  # orphaned ranks re-parent to this driver, so ProcessTree still sees them
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lr-scaling-") as tmp:
        jobs, curve, failed = layer1(args, Path(tmp))
        planning = [time_planning(W, args.plan_reps) for W in args.plan_replicas]
        ledger_path = Path(tmp) / "ledger.jsonl"
        Ws = [w for w in (64, 1024, args.ledger_B // 2, args.ledger_B) if args.ledger_B % w == 0 and w <= args.ledger_B]
        ledger = [ledger_line(args.ledger_B, W, fault, ledger_path) for W in dict.fromkeys(Ws) for fault in (False, True)]

    fits: dict[str, dict[str, float]] = {}
    print(f"\nlayer 1 (FaultTolerantComm, {args.numel} fp32 in {args.bucket_bytes}-byte buckets), one SIGKILL per step, "
          f"median over faults; {os.cpu_count()} cores, ranks oversubscribed past them")
    header = f"{'ranks':>5} " + " ".join(f"{p:>9}" for p in (*PHASES, "recovery")) + f" {'start-up':>9} {'rss/rank':>9}"
    print(header)
    print("-" * len(header))
    for pt in curve:
        m = pt["median_s"]
        print(f"{pt['ranks']:>5} " + " ".join(f"{m[q] * 1e3:>7.1f}ms" for q in (*PHASES, "recovery"))
              + f" {pt['startup_s']:>8.1f}s {pt['peak_rss_mib_max']:>6.0f}MiB")
    for n, why in failed.items():
        print(f"{n:>5} FAILED: {why.splitlines()[0]}")
    if curve:
        print("start-up of the slowest rank: " + ", ".join(
            f"{pt['ranks']}: MPI_Init {pt['mpi_init_s_max']:.1f} s + import {pt['import_comm_s_max']:.1f} s + "
            f"FaultTolerantComm {pt['comm_init_s_max']:.1f} s + torch for the tensors {pt['import_torch_s_max']:.1f} s; "
            f"end of job {pt['end_s']:.1f} s"
            + (" (timed out)" if pt["timed_out"] else "") for pt in curve))
    if len(curve) >= 2:
        print("fitted growth with the world size n (least squares over the medians):")
        ns = [pt["ranks"] for pt in curve]
        for q in (*PHASES, "recovery"):
            fits[q] = print_growth(q, ns, [pt["median_s"][q] for pt in curve])
        fits["startup"] = print_growth("start-up", ns, [pt["startup_s"] for pt in curve])

    print(f"\npolicy planning (StaticWorld, G_init=2, T=W: one contributor lost, its ids replayed), median of {args.plan_reps}")
    print(f"{'W':>8} {'B':>8} {'begin_step':>11} {'fail':>11} {'commit':>11} {'step':>11}")
    for row in planning:
        print(f"{row['W']:>8} {row['B']:>8} " + " ".join(f"{fmt_s(row[k]):>11}" for k in ("begin_step", "fail", "commit", "step")))
    if len(planning) >= 2:
        print("fitted growth with the replicas W:")
        for k in ("begin_step", "fail", "commit", "step"):
            fits[f"plan_{k}"] = print_growth(k, [r["W"] for r in planning], [r[k] for r in planning], unit="W")

    print(f"\nledger line at B = {args.ledger_B} (LedgerWriter: one write + fsync)")
    print(f"{'W':>6} {'G':>5} {'fault':>6} {'bytes':>8} {'ids':>8} {'roles':>8} {'write':>9}")
    for row in ledger:
        print(f"{row['W']:>6} {row['G']:>5} {str(row['fault']):>6} {row['bytes']:>8} {row['microbatch_ids_bytes']:>8} "
              f"{row['roles_bytes']:>8} {fmt_s(row['write_s']):>9}")

    busy = [j["busy_cores_before"] for j in jobs if j["busy_cores_before"] is not None]
    if busy and max(busy) > 0.5:
        print(f"WARNING: other work kept up to {max(busy):.1f} cores busy before a job started; these numbers are noisy")
    leftovers = [e for j in jobs for e in j["leftovers"]]
    if leftovers:
        print(f"note: {len(leftovers)} process(es) outlived their launch and were ended by pid (see [cleanup] lines)")
    if curve and any(pt["torch_loaded_by_comm"] for pt in curve):
        print("note: torch loaded by layer 1 in some rank (importing or building FaultTolerantComm): issue 23's rule is broken")
    elif curve:
        print("note: torch not loaded by layer 1 in any rank (importing and building FaultTolerantComm); the ranks import "
              "it afterwards for their own tensors; "
              "start-up and rss/rank above include it")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "recovery phases of FaultTolerantComm per SIGKILL vs world size; policy planning time vs replicas; ledger line bytes",
        "phases": {p: f"ends when every survivor passed '{PHASE_END[p]}' (scaling_rank.py); timed from the previous phase's end" for p in PHASES},
        "host": {"cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": time.perf_counter() - t_start,
        "jobs": jobs,
        "curve": curve,
        "failed": failed,
        "planning": planning,
        "ledger": ledger,
        "fits": fits,
    }, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    print(headline(curve, planning, ledger, fits, args.ledger_B))
    return 1 if failed else 0


def headline(curve: Sequence[dict[str, Any]], planning: Sequence[dict[str, Any]], ledger: Sequence[dict[str, Any]],
             fits: dict[str, dict[str, float]], B: int) -> str:
    """The last line: recovery time from the smallest to the largest world, its growth, planning and ledger."""
    parts = []
    if len(curve) >= 2:
        lo, hi = curve[0], curve[-1]
        parts.append(f"recovery time {lo['ranks']} -> {hi['ranks']} ranks: {lo['median_s']['recovery']:.2f} s -> "
                     f"{hi['median_s']['recovery']:.2f} s, growth ~ n^{fits['recovery']['power_k']:.2f}")
    elif curve:
        parts.append(f"recovery time at {curve[0]['ranks']} ranks: {curve[0]['median_s']['recovery']:.2f} s")
    else:
        parts.append("recovery time: no job finished")
    if len(planning) >= 2:
        parts.append(f"planning {planning[0]['W']} -> {planning[-1]['W']} replicas: {fmt_s(planning[0]['step'])} -> "
                     f"{fmt_s(planning[-1]['step'])}, ~ W^{fits['plan_step']['power_k']:.2f}")
    big = max((r for r in ledger if r["fault"]), key=lambda r: r["W"], default=None)
    if big is not None:
        parts.append(f"ledger line at B={B}: {big['bytes'] / 1024:.0f} KiB")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
