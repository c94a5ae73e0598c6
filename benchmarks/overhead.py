"""Fault-free step time: ReCoVerHSDPStrategy vs Lightning's stock ModelParallelStrategy HSDP.

Run it as ``python -m benchmarks.overhead`` (about 4-8 minutes on a 2-core machine).
Every measurement is one launched 4-rank job (``lightning-recover launch -n 4``, i.e.
``mpiexec --with-ft ulfm``, for both systems) of ``benchmarks/bench_job.py`` with the
same model (the example GPT, ``--size``), the same samples (both fetch step t's
microbatches through the project's MicrobatchPlanner), the same per-rank microbatch size
and the same global batch per step, for two layouts:

* ``2x2``: 2 replicas x 2 shards. ReCoVer: ``shards=2, grad_accum=G``. Stock:
  ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` with FSDP2
  ``fully_shard`` on its 2-D mesh in ``configure_model`` and ``accumulate_grad_batches=G``.
* ``4x1``: 4 replicas x 1 shard. ReCoVer: ``shards=1``. Stock: the same with
  ``data_parallel_size=4, tensor_parallel_size=1``.

The stock baseline skips gradient sync on the accumulating microbatches (FSDP2
``set_requires_gradient_sync``), the strongest stock configuration; ``--naive`` also
times ``stock-naive`` (Lightning + FSDP2 out of the box, which reduces after every
microbatch because Lightning's ``block_backward_sync`` only knows DDP's ``no_sync``).

The systems run ALTERNATELY: each round runs every (layout, system) once, and the order
is reversed every other round, so slow drifts of a shared machine hit both alike.
The step time is measured inside the job by one callback on rank 0 for every system:
the wall time between consecutive optimizer-step ends (``on_train_batch_end`` where
``trainer.global_step`` advanced), i.e. end to end per step, hidden collectives
included. The first ``--warmup`` steps of every job are skipped. We report the median of
the pooled steady-state step times per (layout, system), a bootstrap 95% interval of
the ratio of medians, and the per-round ratios. Launch/start-up time is reported too
but is not part of the step time.

The machine may be shared: before each job the driver waits (at most ``--quiet-wait``
s) for other work to stop, and it reports, per job, how many cores other processes used
while it ran (``others``: all busy CPU time from /proc/stat minus the job's own CPU time,
over its wall time). Compare ratios from rounds with ``others`` near 0.

Results go to ``benchmarks/results/overhead.json``; the last line printed is the
headline ``ReCoVer/stock step time: 0.93x [95% CI 0.90-0.97] (2x2), ...; peak memory per rank:
1.02x (2x2), ...``. Each rank also records its peak resident memory (``rss<rank>.json``); the
table shows the largest rank's, per system. ``--ablation`` also times every ReCoVer variant
of ``SYSTEM_ARGS``: without the overlap, with a reduce-scatter after every microbatch, on
the gloo data plane, with FSDP2's collectives on torch's gloo group instead of MPI, with
MPI's spinning wait, and with smaller buckets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.common import bootstrap_ratio, launch, loadavg, read_clock, wait_quiet  # noqa: E402
from benchmarks.proctree import become_subreaper  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "overhead.json"
LAYOUTS = {"2x2": 2, "4x1": 1}  # name -> shards (world is always 4 ranks)
# Ablations of ReCoVer: bench_job.py arguments of the named variants.
SYSTEM_ARGS = {
    "recover-no-overlap": ["--system", "recover", "--no-overlap"],
    "recover-sync-every-mb": ["--system", "recover", "--sync-every-microbatch"],
    "recover-gloo-plane": ["--system", "recover", "--data-plane", "gloo"],
    "recover-torch-replica-plane": ["--system", "recover", "--replica-plane", "torch"],
    "recover-spin-wait": ["--system", "recover", "--mpi-wait", "spin"],
    "recover-bucket-0.5mb": ["--system", "recover", "--bucket-mb", "0.5"],
    "recover-bucket-1mb": ["--system", "recover", "--bucket-mb", "1"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (each runs every layout and system once)")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per job")
    p.add_argument("--warmup", type=int, default=4, help="leading step times skipped per job")
    p.add_argument("--size", default="small", help="examples/model.py SIZES entry")
    p.add_argument("--mbs", type=int, default=4, help="per-rank microbatch size")
    p.add_argument("--grad-accum", type=int, default=2, help="G: microbatches per replica per step")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--naive", action="store_true", help="also time stock-naive (gradient sync on every microbatch)")
    p.add_argument("--ddp", action="store_true", help="also time Lightning DDPStrategy (4x1 only)")
    p.add_argument("--systems", nargs="+", default=None, choices=["recover", "stock", *SYSTEM_ARGS],
                   help="time exactly these systems (overrides --naive/--ddp/--ablation; keep recover and stock for the ratios)")
    p.add_argument("--ablation", action="store_true",
                   help="also time every ReCoVer variant (no overlap, reduce-scatter every microbatch, gloo data plane, "
                   "torch replica plane, spinning MPI wait, small buckets)")
    p.add_argument("--quiet-wait", type=float, default=5.0,
                   help="before each job wait up to this many seconds for other work on the machine to stop")
    p.add_argument("--timeout", type=float, default=240, help="hard timeout per launched job, seconds")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def peak_rss(outdir: Path) -> float | None:
    """The largest peak resident memory (MiB) of the job's ranks, from bench_job.py's rss*.json."""
    peaks = [json.loads(f.read_text())["peak_rss_mib"] for f in outdir.glob("rss*.json")]
    return max(peaks) if peaks else None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.warmup >= args.steps - 2:
        raise SystemExit(f"--warmup {args.warmup} leaves too few of --steps {args.steps}; use steps >= warmup + 3")
    systems = (["recover", "stock"] + (["stock-naive"] if args.naive else []) + (["ddp"] if args.ddp else [])
               + (list(SYSTEM_ARGS) if args.ablation else []))
    if args.systems:
        systems = list(dict.fromkeys(["recover", "stock", *args.systems]))
    work = Path(tempfile.mkdtemp(prefix="lr-overhead-"))
    order = [(lay, sy) for lay in args.layouts for sy in systems if not (sy == "ddp" and LAYOUTS[lay] != 1)]
    runs: list[dict] = []
    t_all = time.time()
    print(f"overhead: {args.rounds} rounds x {len(order)} jobs, {args.steps} steps each (work dir {work})", flush=True)
    for rnd in range(args.rounds):
        seq = order if rnd % 2 == 0 else list(reversed(order))
        for lay, sy in seq:
            shards = LAYOUTS[lay]
            outdir = work / f"r{rnd}-{lay}-{sy}"
            job = [*SYSTEM_ARGS.get(sy, ["--system", sy]), "--shards", str(shards), "--grad-accum", str(args.grad_accum), "--mbs", str(args.mbs),
                   "--steps", str(args.steps), "--size", args.size]
            waited, busy = wait_quiet(args.quiet_wait)
            load0 = loadavg()
            res = launch(job, outdir, args.timeout)
            clock = read_clock(outdir / "clock.json")
            ok = res["rc"] == 0 and clock is not None and len(clock["intervals_s"]) >= args.steps - 1
            iv = clock["intervals_s"][args.warmup:] if ok else []
            rec = {"round": rnd, "layout": lay, "system": sy, "ok": ok, "rc": res["rc"], "timed_out": res["timed_out"],
                   "job_wall_s": res["wall_s"], "load_before": load0, "quiet_wait_s": waited, "busy_before_cores": busy,
                   "foreign_cores": res["foreign_cores"], "job_cpu_s": res["job_cpu_s"],
                   "startup_s": (clock["wall_fit_start"] - res["t0"]) if clock else None,
                   "first_step_s": clock["first_step_s"] if clock else None,
                   "intervals_s": clock["intervals_s"] if clock else [], "steady_s": iv,
                   "median_s": statistics.median(iv) if iv else None, "peak_rss_mib": peak_rss(outdir)}
            runs.append(rec)
            status = f"median {rec['median_s']:.3f} s/step" if ok else f"FAILED rc={res['rc']} timed_out={res['timed_out']}"
            fc = res["foreign_cores"]
            print(f"  round {rnd} {lay:4s} {sy:11s} {status}  (job {res['wall_s']:.0f} s, other work on the machine "
                  f"{fc if fc is not None else float('nan'):.2f} cores)", flush=True)
            if not ok:
                print(res["log_tail"][-1500:], file=sys.stderr)
    total = time.time() - t_all

    summary: dict[str, dict] = {}
    for lay in args.layouts:
        s: dict = {}
        for sy in systems:
            mine = [r for r in runs if r["layout"] == lay and r["system"] == sy]
            if not mine:
                continue
            pooled = [x for r in mine if r["ok"] for x in r["steady_s"]]
            fcs = [r["foreign_cores"] for r in mine if r["foreign_cores"] is not None]
            peaks = [r["peak_rss_mib"] for r in mine if r["ok"] and r["peak_rss_mib"] is not None]
            s[sy] = {"n": len(pooled), "median_s": statistics.median(pooled) if pooled else None,
                     "peak_rss_mib": statistics.median(peaks) if peaks else None,
                     "foreign_cores_mean": statistics.fmean(fcs) if fcs else None,
                     "mean_s": statistics.fmean(pooled) if pooled else None,
                     "p10_s": pct(pooled, 0.1), "p90_s": pct(pooled, 0.9), "pooled_s": pooled,
                     "startup_s": statistics.median([r["startup_s"] for r in runs if r["layout"] == lay and r["system"] == sy
                                                     and r["startup_s"] is not None] or [float("nan")])}
        for base in [sy for sy in systems[1:] if sy in s]:
            a, b = s["recover"]["pooled_s"], s[base]["pooled_s"]
            if a and b:
                per_round = []
                for rnd in range(args.rounds):
                    ra = [r for r in runs if r["round"] == rnd and r["layout"] == lay and r["system"] == "recover" and r["ok"]]
                    rb = [r for r in runs if r["round"] == rnd and r["layout"] == lay and r["system"] == base and r["ok"]]
                    if ra and rb:
                        per_round.append(ra[0]["median_s"] / rb[0]["median_s"])
                lo, hi = bootstrap_ratio(a, b)
                s[f"ratio_vs_{base}"] = {"ratio": statistics.median(a) / statistics.median(b), "ci95": [lo, hi],
                                         "per_round": per_round}
        summary[lay] = s

    # ------------------------------------------------------------------ table
    print()
    print(f"model {args.size}, per-rank microbatch {args.mbs}, G={args.grad_accum}, 4 ranks on {os.cpu_count()} cores, "
          f"{args.rounds} alternating rounds, {args.steps} steps/job, first {args.warmup} skipped; total {total:.0f} s")
    hdr = (f"{'layout':6s} {'system':22s} {'n':>4s} {'median s/step':>14s} {'p10':>7s} {'p90':>7s} {'start-up s':>11s} "
           f"{'others':>6s} {'peak MiB/rank':>13s}  ratio ReCoVer/this [95% CI]  per round")
    print(hdr)
    print("-" * len(hdr))
    for lay in args.layouts:
        for sy in [sy for sy in systems if sy in summary[lay]]:
            d = summary[lay][sy]
            rt = summary[lay].get(f"ratio_vs_{sy}")
            rtxt = (f"{rt['ratio']:.3f}x [{rt['ci95'][0]:.2f}, {rt['ci95'][1]:.2f}]  "
                    + " ".join(f"{x:.2f}" for x in rt["per_round"])) if rt else ""
            med = f"{d['median_s']:.3f}" if d["median_s"] is not None else "n/a"
            fc = d["foreign_cores_mean"]
            pk = d["peak_rss_mib"]
            print(f"{lay:6s} {sy:22s} {d['n']:4d} {med:>14s} {d['p10_s']:7.3f} {d['p90_s']:7.3f} {d['startup_s']:11.1f} "
                  f"{fc if fc is not None else float('nan'):6.2f} {pk if pk is not None else float('nan'):13.0f}  {rtxt}")
    print("others: mean cores used by other work on the machine during the jobs (shared machine); "
          "start-up: mpiexec start to on_train_start; peak MiB/rank: the largest rank's peak resident memory "
          "(median over rounds; the whole process: interpreter, torch, MPI buffers, model, gradients, optimizer)")

    import lightning
    import torch

    payload = {
        "benchmark": "overhead", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "lightning": lightning.__version__},
        "method": "median of pooled steady-state per-step wall times (rank 0, consecutive optimizer-step ends), "
                  "systems alternated per round",
        "total_s": total, "summary": summary,
        "runs": [{k: v for k, v in r.items()} for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    parts, mem = [], []
    for lay in args.layouts:
        rt = summary[lay].get("ratio_vs_stock")
        parts.append(f"{rt['ratio']:.2f}x [95% CI {rt['ci95'][0]:.2f}-{rt['ci95'][1]:.2f}] ({lay})" if rt else f"n/a ({lay})")
        a, b = (summary[lay].get(sy, {}).get("peak_rss_mib") for sy in ("recover", "stock"))
        mem.append(f"{a / b:.2f}x ({lay})" if a and b else f"n/a ({lay})")
    print("ReCoVer/stock step time: " + ", ".join(parts) + "; peak memory per rank: " + ", ".join(mem))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    become_subreaper()  # a launch's orphans re-parent to us, so its cleanup still finds them
    sys.exit(main())
