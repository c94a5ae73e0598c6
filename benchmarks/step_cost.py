"""Fault-free step time of ReCoVer next to torchft's, per model size, in one run.

Run it as ``python -m benchmarks.step_cost`` (torchft from the ``peers`` extra; about 6
minutes on a 2-core machine); ``--quick`` is the CI smoke run (tiny model, a few steps,
torchft only if installed).

The two systems are the fault-free runs of ``benchmarks/peers.py`` (``recover-ff`` and
``torchft-ff``), launched by its own functions (:func:`peers.run_recover`,
:func:`peers.run_torchft`): the example GPT of ``--sizes`` on the same bytes, 4 replicas x
1 rank, microbatches of ``--mbs`` sequences, G = ``--grad-accum`` per replica per step,
AdamW, one thread per rank. ReCoVer is the whole product as a user runs it:
ReCoVerHSDPStrategy inside Lightning's fit loop, the step ledger, the hang watchdog, the
buffer sync, the progress logging; torchft is its plain training loop
(``peers_torchft_worker.py``: Manager, ProcessGroupGloo, its DDP and optimizer wrapper).

Step time: the median interval between consecutive committed steps (ReCoVer: rank 0's
step clock; torchft: the commit times its groups logged), after the first ``--skip``
steps (start-up, allocator warm-up). The machine is shared and noisy, so the two systems
alternate (``--repeats`` rounds of ReCoVer then torchft per size, each after waiting for
the machine to be quiet; every other round starts with torchft) and the figure per
system is the median over its rounds; each round's own ratio is printed too. The last
line is the headline: ReCoVer / torchft step time per size, with the targets.
Results go to ``benchmarks/results/step_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from benchmarks import peers
from benchmarks.proctree import become_subreaper

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "step_cost.json"
#: Issue 23's acceptance: ReCoVer's fault-free step at most this many times torchft's.
TARGETS = {"tiny": 1.2, "small": 1.05}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], help="examples/model.py SIZES entries")
    p.add_argument("--steps", type=int, default=120, help="committed steps per run")
    p.add_argument("--skip", type=int, default=10, help="leading steps left out of the step time")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds of both systems per size")
    p.add_argument("--mbs", type=int, default=4, help="microbatch size (sequences)")
    p.add_argument("--grad-accum", type=int, default=2, help="G: microbatches per replica per step")
    p.add_argument("--systems", nargs="+", default=["recover-ff", "torchft-ff"], choices=["recover-ff", "torchft-ff"])
    p.add_argument("--timeout", type=float, default=600, help="hard limit per run, seconds")
    p.add_argument("--quiet-wait", type=float, default=5.0,
                   help="before each run wait up to this many seconds for other work on the machine to stop")
    p.add_argument("--quick", action="store_true", help="CI smoke run: tiny, 12 steps, 1 round; torchft only if installed")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.skip, args.repeats = ["tiny"], 12, 2, 1
        if shutil.which("torchft_lighthouse") is None:
            args.systems = [s for s in args.systems if s != "torchft-ff"]
    if args.steps < args.skip + 3:
        p.error(f"--steps {args.steps} leaves fewer than 2 step intervals after --skip {args.skip}; raise --steps")
    if "torchft-ff" in args.systems and shutil.which("torchft_lighthouse") is None:
        p.error("torchft is not installed (no torchft_lighthouse on PATH): pip install -e '.[peers]' with your torch "
                "already installed, or run --systems recover-ff")
    return args


def step_intervals(run: peers.Run, skip: int) -> list[float]:
    """Seconds between consecutive committed steps from step ``skip`` on (pure: tests call it)."""
    steps = [s for s in sorted(run.steps) if s >= skip]
    return [run.steps[b].t - run.steps[a].t for a, b in zip(steps, steps[1:]) if b == a + 1]


def size_row(ours: list[list[float]], peer: list[list[float]]) -> dict:
    """One size's figures from each round's step intervals (seconds) of both systems (pure: tests call it).

    ``recover_ms`` / ``torchft_ms``: the median over rounds of each run's median step;
    ``ratio``: the median over rounds of the round's own ratio (round i pairs the i-th runs);
    ``q1_ratio``: the same with lower quartiles. None where a system has no runs.
    """
    def med(runs: list[list[float]], q: int = 50) -> list[float]:
        return [_pct(iv, q) if q != 50 else statistics.median(iv) for iv in runs if iv]

    m_ours, m_peer = med(ours), med(peer)
    row: dict = {"recover_ms": statistics.median(m_ours) * 1e3 if m_ours else None,
                 "torchft_ms": statistics.median(m_peer) * 1e3 if m_peer else None,
                 "rounds_ms": [(a * 1e3, b * 1e3) for a, b in zip(m_ours, m_peer)]}
    ratios = [a / b for a, b in zip(m_ours, m_peer)]
    q1 = [a / b for a, b in zip(med(ours, 25), med(peer, 25))]
    row["round_ratios"] = ratios
    row["ratio"] = statistics.median(ratios) if ratios else None
    row["q1_ratio"] = statistics.median(q1) if q1 else None
    return row


def peers_args(args: argparse.Namespace, size: str) -> argparse.Namespace:
    """The namespace peers.py's run functions read, for one size (no kills: fault-free)."""
    return argparse.Namespace(steps=args.steps, size=size, mbs=args.mbs, grad_accum=args.grad_accum,
                              timeout=args.timeout, kill_plan=[], data_plane="mpi")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.common import wait_quiet

    work = Path(tempfile.mkdtemp(prefix="lr-stepcost-"))
    print(f"step_cost: {peers.REPLICAS} replicas x 1 rank on {os.cpu_count()} cores, sizes {args.sizes}, {args.steps} "
          f"steps (first {args.skip} left out), B = {peers.REPLICAS} x {args.grad_accum} microbatches x {args.mbs}; "
          f"{args.repeats} alternating round(s) of {args.systems} (work dir {work})", flush=True)
    # Per size and system, each round's step intervals (in round order).
    intervals: dict[str, dict[str, list[list[float]]]] = {size: {s: [] for s in args.systems} for size in args.sizes}
    runs: list[dict] = []
    ok = True
    for size in args.sizes:
        pargs = peers_args(args, size)
        indices = peers.planner_indices(pargs)
        for rnd in range(args.repeats):
            # ABBA: every other round starts with the other system, so a drift in the machine's
            # load over the run weighs on both alike.
            for name in (args.systems if rnd % 2 == 0 else args.systems[::-1]):
                _, busy = wait_quiet(args.quiet_wait)
                outdir = work / f"{size}-{name}-{rnd}"
                if name == "recover-ff":
                    run = peers.run_recover(pargs, name, outdir, rejoin=False, kills=[], indices=indices)
                else:
                    run = peers.run_torchft(pargs, name, outdir, heartbeat_ms=5000, pg_timeout=5.0, kills=[])
                iv = step_intervals(run, args.skip)
                med = statistics.median(iv) if iv else float("nan")
                ok &= run.ok and bool(iv)
                if iv:
                    intervals[size][name].append(iv)
                runs.append({"size": size, "system": name, "round": rnd, "ok": run.ok, "wall_s": run.wall_s,
                             "median_step_s": med, "intervals_s": iv, "busy_before": busy, "notes": run.notes,
                             "leftovers": run.leftovers})
                print(f"  {size:6s} {name:11s} round {rnd}: {'ok' if run.ok else 'FAILED'}, median step "
                      f"{med * 1e3:7.1f} ms over {len(iv)} intervals (p10 {_pct(iv, 10) * 1e3:.1f}, p90 "
                      f"{_pct(iv, 90) * 1e3:.1f}); {run.wall_s:.1f} s wall", flush=True)
                if not run.ok:
                    print(run.log_tail[-2500:], file=sys.stderr)
                if run.leftovers:
                    print(f"  cleanup: {len(run.leftovers)} process(es) had to be ended: {', '.join(run.leftovers)}")

    print()
    print(f"{'size':6s} {'ReCoVer ms':>10s} {'torchft ms':>10s} {'ratio':>6s} {'q1 ratio':>8s} {'target':>6s}  "
          "rounds: ReCoVer / torchft median ms (ratio)")
    table: dict[str, dict] = {}
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    for size in args.sizes:
        row = table[size] = size_row(intervals[size].get("recover-ff", []), intervals[size].get("torchft-ff", []))
        rounds = ", ".join(f"{a:.1f}/{b:.1f} ({a / b:.2f}x)" for a, b in row["rounds_ms"]) if row["rounds_ms"] else \
            ", ".join(f"{statistics.median(iv) * 1e3:.1f}" for iv in intervals[size].get("recover-ff", []))
        print(f"{size:6s} {fmt(row['recover_ms'], '10.1f'):>10s} {fmt(row['torchft_ms'], '10.1f'):>10s} "
              f"{fmt(row['ratio'], '6.2f'):>6s} {fmt(row['q1_ratio'], '8.2f'):>8s} {fmt(TARGETS.get(size), '6.2f'):>6s}  {rounds}")
    print("ratio: the median over rounds of each round's ReCoVer / torchft median step (the two runs of a round ran back to "
          "back, under about the same load); q1 ratio: the same with each run's lower-quartile step, closer to an idle "
          "machine's (other work only ever adds time)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "step_cost", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1min_at_end": os.getloadavg()[0]},
        "table": table, "runs": runs}, indent=1))
    print(f"wrote {args.out}")
    parts = []
    for size, row in table.items():
        if row["ratio"] is not None:
            target = TARGETS.get(size)
            parts.append(f"{size} {row['ratio']:.2f}x (medians {row['recover_ms']:.1f} vs {row['torchft_ms']:.1f} ms, "
                         f"lower quartiles {row['q1_ratio']:.2f}x"
                         + (f", target <= {target:.2f}x: {'met' if row['ratio'] <= target else 'NOT met'})" if target else ")"))
        elif row["recover_ms"] is not None:
            parts.append(f"{size} ReCoVer {row['recover_ms']:.1f} ms (torchft not run)")
    print("ReCoVer / torchft fault-free step time: " + ("; ".join(parts) if parts else "n/a (every run failed)"))
    return 0 if ok else 1


def _pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, len(s) * q // 100)]


if __name__ == "__main__":
    become_subreaper()  # a launch's orphans re-parent to us, so its cleanup still finds them
    sys.exit(main())
