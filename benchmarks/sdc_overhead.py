"""Step-time overhead of the silent-data-corruption check: fingerprints at N = 1 and at the default N vs off.

Run it as ``python -m benchmarks.sdc_overhead`` (about 3-5 minutes on a 2-core machine).
Each measurement is one launched 4-rank job of ``benchmarks/bench_job.py`` (the example
GPT, ReCoVer, 4 replicas x 1 shard or 2 x 2) with ``recover.sdc.every_n_steps`` = 0 (off),
1, and the library default; the jobs run ALTERNATELY, order reversed every other round,
so drifts of a shared machine hit all alike. The step time is the wall time between
consecutive optimizer-step ends on rank 0 (bench_job's clock), first ``--warmup`` steps
skipped; we report the median of the pooled steady-state step times, the ratio to "off"
with a bootstrap 95% interval, and the per-round ratios.

With N = 1 every step pays one fingerprint of the rank's parameter shards and optimizer
state (one pass over them) and one small gather; at N it is paid once per N steps.

Results go to ``benchmarks/results/sdc_overhead.json``; the last line printed is the headline
``SDC check step-time overhead vs off: N=1 1.03x, N=20 (default) 1.00x (4x1)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from benchmarks.common import bootstrap_ratio, launch, read_clock, wait_quiet

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "sdc_overhead.json"


def default_every() -> int:
    from lightning_recover.config import SDCConfig

    return SDCConfig().every_n_steps


def fingerprint_cost(size: str, repeats: int = 10) -> tuple[float, int]:
    """Median seconds of one fingerprint of the example GPT's parameters + AdamW state, in this process; and its bytes."""
    import torch
    from examples.model import GPT, SIZES

    from lightning_recover.audit.corruption import fingerprint
    from lightning_recover.callbacks.corruption_check import state_tensors

    torch.set_num_threads(1)
    model = GPT(**SIZES[size], dropout=0.0, warmup_steps=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # creates the optimizer state the check covers
    tensors = state_tensors(model, [opt])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fingerprint(tensors)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(t.numel() * t.element_size() for t in tensors)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--size", default="small")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--shards", type=int, default=1, help="1: 4x1, 2: 2x2")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--quiet-wait", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    default = default_every()
    settings = [0, 1] + ([default] if default > 1 else [])
    layout = f"{4 // args.shards}x{args.shards}"
    work = Path(tempfile.mkdtemp(prefix="lr-sdc-"))
    print(f"sdc_overhead: {layout}, {args.rounds} rounds x N in {settings}, {args.steps} steps each (work dir {work})", flush=True)
    runs: list[dict] = []
    t_all = time.time()
    for rnd in range(args.rounds):
        order = settings if rnd % 2 == 0 else settings[::-1]
        for n in order:
            wait_quiet(args.quiet_wait)
            out = work / f"r{rnd}-n{n}"
            job = ["--system", "recover", "--shards", str(args.shards), "--grad-accum", str(args.grad_accum), "--mbs",
                   str(args.mbs), "--steps", str(args.steps), "--size", args.size, "--sdc-every", str(n)]
            res = launch(job, out, args.timeout)
            clock = read_clock(out / "clock.json")
            iv = (clock["intervals_s"] if clock else [])[args.warmup:]
            ok = res["rc"] == 0 and bool(iv)
            runs.append({"round": rnd, "n": n, "ok": ok, "steady_s": iv, "median_s": statistics.median(iv) if iv else None,
                         "foreign_cores": res["foreign_cores"]})
            fc = res["foreign_cores"]
            print(f"  round {rnd} N={n:<3d} " + (f"median {runs[-1]['median_s']:.4f} s/step" if ok else f"FAILED rc={res['rc']}")
                  + f"  (other work {fc if fc is not None else float('nan'):.2f} cores)", flush=True)
            if not ok:
                print(res["log_tail"][-1500:], file=sys.stderr)
    pooled = {n: [x for r in runs if r["n"] == n and r["ok"] for x in r["steady_s"]] for n in settings}
    print()
    print(f"{'N':>5s} {'median s/step':>14s} {'vs off':>8s} {'95% CI':>16s}  per round")
    summary = {}
    for n in settings:
        med = statistics.median(pooled[n]) if pooled[n] else float("nan")
        row = {"median_s": med, "n_steps": len(pooled[n])}
        if n and pooled[n] and pooled[0]:
            lo, hi = bootstrap_ratio(pooled[n], pooled[0])
            per = []
            for rnd in range(args.rounds):
                a = [r for r in runs if r["round"] == rnd and r["n"] == n and r["ok"]]
                b = [r for r in runs if r["round"] == rnd and r["n"] == 0 and r["ok"]]
                if a and b:
                    per.append(a[0]["median_s"] / b[0]["median_s"])
            row.update(ratio=med / statistics.median(pooled[0]), ci95=[lo, hi], per_round=per)
            print(f"{n:5d} {med:14.4f} {row['ratio']:7.3f}x {f'[{lo:.3f}, {hi:.3f}]':>16s}  " + " ".join(f"{x:.3f}" for x in per))
        else:
            print(f"{n:5d} {med:14.4f} {'-':>8s} {'':>16s}")
        summary[n] = row
    cost, nbytes = fingerprint_cost(args.size)
    step = summary[0]["median_s"]
    print(f"one fingerprint of a rank's parameters + AdamW state ({nbytes / 2**20:.1f} MiB), measured in one process: "
          f"{cost * 1e3:.1f} ms = {100 * cost / step:.2f}% of a median step at N=1, "
          f"{100 * cost / step / max(default, 1):.3f}% at N={default} (the gather of 16 bytes per rank comes on top)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "sdc_overhead", "layout": layout, "default_every_n_steps": default,
                                    "fingerprint_s": cost, "fingerprint_bytes": nbytes,
                                    "config": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                    "runs": runs, "total_s": time.time() - t_all}, indent=1))
    print(f"wrote {args.out}")
    parts = [f"N={n}{' (default)' if n == default else ''} " + (f"{summary[n]['ratio']:.3f}x" if "ratio" in summary[n] else "n/a")
             for n in settings if n]
    print(f"SDC check step-time overhead vs off: {', '.join(parts)} ({layout})")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
