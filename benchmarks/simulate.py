"""Discrete-event goodput simulator: checkpoint-restart, torchft-like, FT-HSDP and ReCoVer at 1k-100k GPUs.

Run it as ``python -m benchmarks.simulate`` (about a second; no MPI, torch or GPU needed).
The model lives in ``benchmarks/goodput_model.py``; its docstring states every assumption.
In short: each GPU fails as a Poisson process (per-GPU MTBF, default 50,000 h), a failure
kills its replica (``--gpus-per-replica`` GPUs, default 8), and over ``--days`` of simulated
wall time (default 30), repeated ``--reps`` times (default 20), we compare

* **checkpoint-restart** at the Young/Daly interval ``tau = sqrt(2 delta M)`` (``--interval
  daly`` for Daly's higher-order optimum): a failure loses the work since the last checkpoint
  and costs the restart ``R`` (``--restart-min``, default 10); each checkpoint write costs
  ``delta`` (``--checkpoint-min``, default 1: a blocking write of a large model's sharded
  state at scale; asynchronous checkpointing would be seconds). The table also gives Daly's
  higher-order closed form for the same tau, which the simulation matches in expectation.
* **torchft-like** (AdaptiveWorld): each failure stalls the job for the detection timeout
  (``--adaptive-timeout-s``, default 5: torchft's lighthouse heartbeat timeout), then it
  trains on with fewer replicas and a smaller global batch. Goodput counts every sample it
  trains on; its batch drift is reported as the share of steps at the target batch and the
  smallest batch fraction seen.
* **FT-HSDP** (Meta): its published stall of 3 minutes per failure at 100k GPUs
  (``--ft-hsdp-pause-s``, applied at every size), a batch that shrinks as torchft's.
* **ReCoVer**: each failure stalls the job for its per-fault pause, and every step pays the
  protocol's fault-free overhead; both are computed **per job size from measurements**:
  the rank's bookkeeping from ``benchmarks/scale.py``'s fitted curves (``--scale-from``: a
  steady step, a lost replica's step and the re-plan that follows, ``a * W^k`` at W
  replicas) plus the control plane from ``benchmarks/control_plane_model.py`` (the MPI calls
  ``control_plane.py`` counted, timed by the published ULFM agreement, revoke and detection
  measurements, extrapolated in log n). ``--pause-s`` or ``--pause-from LEDGER.jsonl`` (the
  mean nonzero ``recovery_s`` of a lightning-recover ledger's faulted steps) replace the
  control plane's share of the pause by a number measured at this machine's size; the
  bookkeeping's growth is still added. The inputs of every size are printed. B stays
  constant, so while replicas are down the survivors' steps take ``W / W_cur`` longer
  (``--grad-accum G`` quantises this). Two ReCoVer systems are simulated on the same failures:

  - **without re-join**: lost replicas never come back (the ReCoVer paper, and a
    lightning-recover job without ``recover.rejoin``), so they accumulate over the window;
  - **with re-join** (``recover.rejoin=true``): a replacement joins after ``--repair-min``
    (default 30) and each join blocks the survivors for the join pause: the median
    ``pause_s`` of the ``joins`` recorded in the ``--pause-from`` ledger, or, when there is
    no ledger or it records no join, ``--rejoin-pause-s`` (default 5 s, assumed).

  Both again **with salvage** (``recover.salvage=true``, issue 37): a failure takes one GPU of a
  uniform shard index, the replica's other GPUs wait as orphans, and a replica re-forms from
  orphans whenever they hold every shard index (a join pause each); with re-join only the
  failed GPU comes back after ``--repair-min``, as an orphan. The last two table columns.

AdaptiveWorld's replicas also come back after ``--repair-min``, each stalling it for
``--rejoin-pause-s`` (a communicator rebuild). ``--repair-min inf`` makes both ReCoVer
columns the system without re-join. Goodput is useful work / wall time, as a fraction of
the fault-free rate.

Prints where each pause came from, a table with both ReCoVer systems, writes
``benchmarks/results/simulate.json`` and ``benchmarks/results/simulate.png`` (goodput vs job
size, log x). The last line printed is the headline: ReCoVer's goodput at the largest job
size and its ratio to checkpoint-restart at the smallest and the largest, each without and
with re-join.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import control_plane_model  # noqa: E402
from benchmarks.goodput_model import (  # noqa: E402
    DAY,
    HOUR,
    JobResult,
    ModelParams,
    Stat,
    pause_from_ledger,
    rejoin_pause_from_ledger,
    simulate_job,
)

RESULTS = ROOT / "benchmarks" / "results"
#: scale.py's result kept with the code (its provenance inside); a fresh run's results/scale.json wins.
MEASURED_SCALE = ROOT / "benchmarks" / "measured" / "scale.json"
DEFAULT_SIZES = [1024, 4096, 16384, 32768, 100_000]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--job-sizes", type=int, nargs="+", default=DEFAULT_SIZES, metavar="GPUS",
                   help="job sizes in GPUs (each a multiple of --gpus-per-replica)")
    p.add_argument("--gpu-mtbf-h", type=float, default=50_000.0, help="per-GPU MTBF in hours (inf: no failures)")
    p.add_argument("--gpus-per-replica", type=int, default=8, help="GPUs per replica (the fault unit)")
    p.add_argument("--restart-min", type=float, default=10.0, help="checkpoint-restart: restart cost R in minutes")
    p.add_argument("--checkpoint-min", type=float, default=1.0, help="checkpoint-restart: checkpoint write cost delta in minutes")
    p.add_argument("--interval", choices=("young", "daly"), default="young",
                   help="checkpoint interval: young = sqrt(2 delta M), daly = Daly's higher-order optimum")
    pause = p.add_mutually_exclusive_group()
    pause.add_argument("--pause-s", type=float, default=None, help="ReCoVer per-fault pause in seconds (default 0.05)")
    pause.add_argument("--pause-from", "--ledger", dest="pause_from", type=Path, default=None,
                       metavar="LEDGER.jsonl",
                       help="take ReCoVer's pauses from a step ledger: per fault, the mean nonzero recovery_s of "
                            "faulted steps; per join, the median pause_s of its joins (none: --rejoin-pause-s)")
    p.add_argument("--adaptive-timeout-s", type=float, default=5.0,
                   help="torchft-like (AdaptiveWorld) per-fault pause: the lighthouse heartbeat timeout")
    p.add_argument("--ft-hsdp-pause-s", type=float, default=180.0, help="FT-HSDP's stall per failure (published at 100k GPUs)")
    p.add_argument("--scale-from", type=Path, default=None,
                   help="scale.py's result (default: benchmarks/results/scale.json if present, else benchmarks/measured/scale.json)")
    p.add_argument("--step-s", type=float, default=5.0, help="a fault-free training step's time, which the protocol's overhead adds to")
    p.add_argument("--repair-min", type=float, default=30.0,
                   help="minutes until a lost replica's replacement joins, for AdaptiveWorld and ReCoVer with "
                        "re-join (inf: never; ReCoVer without re-join always uses inf)")
    p.add_argument("--rejoin-pause-s", type=float, default=5.0,
                   help="job stall per re-join: AdaptiveWorld's, and ReCoVer's unless the --pause-from ledger "
                        "records joins")
    p.add_argument("--grad-accum", type=int, default=0,
                   help="ReCoVer's initial accumulation steps G for quantised step times (0: fluid, rate W_cur/W)")
    p.add_argument("--recover-overhead", type=float, default=0.0,
                   help="ReCoVer's fault-free step-time overhead as a fraction (e.g. from overhead.py)")
    p.add_argument("--days", type=float, default=30.0, help="simulated wall time per run, in days")
    p.add_argument("--reps", type=int, default=20, help="repetitions (independent seeds) per job size and system")
    p.add_argument("--seed", type=int, default=0, help="base seed")
    p.add_argument("--out", type=Path, default=RESULTS / "simulate.json", help="JSON results file")
    p.add_argument("--figure", type=Path, default=RESULTS / "simulate.png", help="PNG figure")
    p.add_argument("--no-figure", action="store_true", help="skip the figure (no matplotlib needed)")
    args = p.parse_args(argv)

    def bad(flag: str, value: object, need: str) -> None:
        p.error(f"{flag} must be {need} (got {value})")

    for flag, v in (("--gpu-mtbf-h", args.gpu_mtbf_h), ("--checkpoint-min", args.checkpoint_min),
                    ("--days", args.days), ("--step-s", args.step_s)):
        if math.isnan(v) or v <= 0:
            bad(flag, v, "> 0")
    for flag, v in (("--restart-min", args.restart_min), ("--adaptive-timeout-s", args.adaptive_timeout_s),
                    ("--repair-min", args.repair_min), ("--rejoin-pause-s", args.rejoin_pause_s),
                    ("--ft-hsdp-pause-s", args.ft_hsdp_pause_s)):
        if math.isnan(v) or v < 0:
            bad(flag, v, ">= 0")
    for flag, v in (("--checkpoint-min", args.checkpoint_min), ("--days", args.days),
                    ("--restart-min", args.restart_min), ("--adaptive-timeout-s", args.adaptive_timeout_s),
                    ("--rejoin-pause-s", args.rejoin_pause_s)):
        if math.isinf(v):
            bad(flag, v, "finite")
    if args.pause_s is not None and (math.isnan(args.pause_s) or args.pause_s < 0 or math.isinf(args.pause_s)):
        bad("--pause-s", args.pause_s, "a finite number >= 0")
    if args.gpus_per_replica < 1:
        bad("--gpus-per-replica", args.gpus_per_replica, ">= 1")
    for n in args.job_sizes:
        if n < args.gpus_per_replica or n % args.gpus_per_replica:
            bad("--job-sizes", n, f"a positive multiple of --gpus-per-replica={args.gpus_per_replica}")
    if args.grad_accum < 0:
        bad("--grad-accum", args.grad_accum, ">= 0")
    if not 0.0 <= args.recover_overhead < 1.0:
        bad("--recover-overhead", args.recover_overhead, "a fraction in [0, 1)")
    if args.reps < 1:
        bad("--reps", args.reps, ">= 1")
    # Where each ReCoVer pause comes from, printed beside the numbers.
    args.recover_rejoin_pause_s = args.rejoin_pause_s
    args.joins = None
    if args.pause_from is not None:
        try:
            args.pause_s, args.pause_steps = pause_from_ledger(args.pause_from)
            measured = rejoin_pause_from_ledger(args.pause_from)
        except (OSError, ValueError) as exc:
            p.error(f"--pause-from {args.pause_from}: {exc}")
        steps = f"{args.pause_steps} faulted step{'s' * (args.pause_steps != 1)}"
        args.pause_source = f"measured: mean recovery_s of {steps} of {args.pause_from}"
        if measured is None:
            args.rejoin_pause_source = (
                f"--rejoin-pause-s, assumed: {args.pause_from} records no join with a measured pause_s"
            )
        else:
            args.recover_rejoin_pause_s, args.joins = measured
            args.rejoin_pause_source = (f"measured: median pause_s of {args.joins} join{'s' * (args.joins != 1)} "
                                       f"in {args.pause_from}")
    else:
        args.pause_steps = None
        args.pause_source = "control-plane model (benchmarks/control_plane_model.py)" if args.pause_s is None else "--pause-s"
        args.rejoin_pause_source = "--rejoin-pause-s, assumed; measure it with --pause-from LEDGER of a re-join run"
    if args.scale_from is None:
        fresh = RESULTS / "scale.json"
        args.scale_from = fresh if fresh.is_file() else MEASURED_SCALE
    try:
        args.fits = fitted_costs(args.scale_from)
    except (OSError, ValueError, KeyError) as exc:
        p.error(f"--scale-from {args.scale_from}: {exc}; run python -m benchmarks.scale to measure it")
    return args


def fitted_costs(path: Path) -> dict[str, tuple[float, float]]:
    """``{quantity: (a, k)}``, cost = a * W^k seconds at W replicas: a scale.py result's ``curves``."""
    curves = json.loads(Path(path).read_text())["curves"]
    return {key: (float(a), float(k)) for key, (a, k) in curves.items()}


def measured_inputs(gpus: int, args: argparse.Namespace) -> dict[str, float]:
    """ReCoVer's per-fault pause and per-step overhead at ``gpus`` GPUs, and what they rest on."""
    W = gpus // args.gpus_per_replica

    def book(key: str) -> float:
        a, k = args.fits[key]
        return a * W**k

    control_pause = control_plane_model.fault_pause_seconds(gpus, failed=args.gpus_per_replica)
    base = control_pause if args.pause_s is None else args.pause_s
    bookkeeping_loss = book("engine_loss_s") + book("engine_replan_s")
    step_extra = book("rank_step_s") + control_plane_model.steady_step_seconds(gpus)
    return {
        "gpus": gpus,
        "replicas": W,
        "pause_s": base + bookkeeping_loss,
        "control_plane_pause_s": control_pause,
        "bookkeeping_loss_s": bookkeeping_loss,
        "step_overhead_s": step_extra,
        "overhead": min(0.99, args.recover_overhead + step_extra / args.step_s),
    }


def size_label(n: int) -> str:
    """1024 -> '1k', 16384 -> '16k', 100000 -> '100k', 1000 -> '1k', 1536 -> '1536'."""
    if n % 1024 == 0:
        return f"{n // 1024}k"
    if n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def fmt_duration(s: float) -> str:
    if math.isinf(s):
        return "inf"
    if s >= 2 * HOUR:
        return f"{s / HOUR:.1f} h"
    return f"{s / 60:.1f} min"


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def table(rows: list[JobResult]) -> list[str]:
    head1 = (f"{'':>7} {'':>6} {'':>9} {'':>8} | {'':>6} {'':>6} | {'torchft-like':^35} | {'FT-HSDP':>7} | "
             f"{'ReCoVer, no re-join':^19} | {'ReCoVer, re-join':^19} | {'+ salvage':^17}").rstrip()
    head = (f"{'GPUs':>7} {'repl.':>6} {'job MTBF':>9} {'CR tau':>8} | {'CR sim':>6} {'Daly':>6} | "
            f"{'goodput':>7} {'meanB':>8} {'minB':>7} {'@B':>6} | {'goodput':>7} | {'goodput':>7} {'/CR':>11} | "
            f"{'goodput':>7} {'/CR':>11} | {'no rj':>8} {'re-join':>8}")
    out = [head1, head, "-" * len(head)]
    for r in rows:
        ft = r.ft_hsdp.mean if r.ft_hsdp is not None else math.nan
        out.append(
            f"{r.gpus:>7} {r.replicas:>6} {fmt_duration(r.job_mtbf_s):>9} {fmt_duration(r.tau_s):>8} | "
            f"{r.checkpoint_restart.mean:6.3f} {r.daly_goodput:6.3f} | "
            f"{r.adaptive.mean:7.3f} {100 * r.adaptive_batch_mean.mean:7.3f}% {100 * r.adaptive_batch_min.mean:6.2f}% "
            f"{100 * r.adaptive_full_batch_share.mean:5.1f}% | {ft:7.3f} | "
            f"{r.recover_no_rejoin.mean:7.4f} {r.ratio_no_rejoin:10.2f}x | {r.recover.mean:7.4f} {r.ratio:10.2f}x | "
            f"{_mean(r.recover_salvage_no_rejoin):8.4f} {_mean(r.recover_salvage):8.4f}"
        )
    return out


def _mean(stat: Stat | None) -> float:
    return stat.mean if stat is not None else math.nan


def inputs_table(inputs: list[dict[str, float]]) -> list[str]:
    """What ReCoVer's numbers rest on, per job size."""
    out = [f"{'GPUs':>7} {'repl.':>6} | {'fault pause':>11} = {'control plane':>13} + {'bookkeeping':>11} | "
           f"{'step overhead':>13} {'fraction':>9}"]
    for i in inputs:
        out.append(f"{i['gpus']:>7} {i['replicas']:>6} | {i['pause_s'] * 1e3:9.2f}ms = {i['control_plane_pause_s'] * 1e3:11.2f}ms + "
                   f"{i['bookkeeping_loss_s'] * 1e3:9.2f}ms | {i['step_overhead_s'] * 1e3:11.3f}ms {i['overhead']:9.2e}")
    return out


def headline(rows: list[JobResult], args: argparse.Namespace) -> str:
    """The last line: ReCoVer's goodput and its ratio to checkpoint-restart, without / with re-join."""
    small, large = rows[0], rows[-1]
    ratios = [f"{r.ratio_no_rejoin:.2f}x / {r.ratio:.2f}x at {size_label(r.gpus)} GPUs"
              for r in ([small, large] if len(rows) > 1 else [large])]
    rejoin = ("never" if math.isinf(args.repair_min)
              else f"after {args.repair_min:g} min, {args.recover_rejoin_pause_s:.3g} s join pause")
    peers = (f"torchft-like {large.adaptive.mean:.3f}, FT-HSDP {large.ft_hsdp.mean:.3f}, checkpoint-restart "
             f"{large.checkpoint_restart.mean:.3f}" if large.ft_hsdp is not None else "")
    return (f"ReCoVer over {args.days:g} days without / with re-join ({rejoin}): goodput "
            f"{large.recover_no_rejoin.mean:.3f} / {large.recover.mean:.3f} at {size_label(large.gpus)} GPUs "
            f"({peers}); vs checkpoint-restart {', '.join(ratios)}; with salvage {_mean(large.recover_salvage_no_rejoin):.3f} / "
            f"{_mean(large.recover_salvage):.3f}")


def plot(rows: list[JobResult], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.gpus for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    series = (
        (f"ReCoVer with re-join ({args.recover_rejoin_pause_s:.3g} s join pause)", [r.recover for r in rows],
         "tab:green", "o"),
        ("ReCoVer without re-join (world only shrinks)", [r.recover_no_rejoin for r in rows], "tab:olive", "D"),
        ("ReCoVer with salvage, without re-join (orphans re-form replicas)",
         [r.recover_salvage_no_rejoin or r.recover_no_rejoin for r in rows], "tab:cyan", "P"),
        (f"torchft-like ({args.adaptive_timeout_s:g} s timeout, shrinking B)", [r.adaptive for r in rows], "tab:orange", "s"),
        (f"FT-HSDP ({args.ft_hsdp_pause_s:g} s stall, shrinking B)", [r.ft_hsdp for r in rows], "tab:purple", "v"),
        ("checkpoint-restart (Young/Daly tau)" if args.interval == "young" else "checkpoint-restart (Daly tau)",
         [r.checkpoint_restart for r in rows], "tab:red", "^"),
    )
    for label, stats, color, marker in series:
        ax.errorbar(x, [s.mean for s in stats], yerr=[s.ci95 for s in stats], label=label, color=color,
                    marker=marker, capsize=3)
    ax.plot(x, [r.daly_goodput for r in rows], "--", color="tab:red", alpha=0.6, label="Daly higher-order closed form")
    ax.set_xscale("log")
    ax.set_xticks(x, [size_label(n) for n in x])
    ax.minorticks_off()
    ax.set_xlabel("job size (GPUs)")
    ax.set_ylabel("goodput (fraction of fault-free)")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(f"per-GPU MTBF {args.gpu_mtbf_h:g} h, R {args.restart_min:g} min, delta {args.checkpoint_min:g} min, "
                 f"fault pause measured per size, repair {args.repair_min:g} min", fontsize=9)
    ax2.plot(x, [100 * r.adaptive_full_batch_share.mean for r in rows], "s-", color="tab:orange",
             label="torchft-like: steps at target B")
    ax2.plot(x, [100 * r.adaptive_batch_min.mean for r in rows], "s:", color="tab:orange", alpha=0.7,
             label="torchft-like: smallest batch (% of B)")
    ax2.axhline(100, color="tab:green", label="ReCoVer: every step at B")
    ax2.set_xscale("log")
    ax2.set_xticks(x, [size_label(n) for n in x])
    ax2.minorticks_off()
    ax2.set_xlabel("job size (GPUs)")
    ax2.set_ylabel("%")
    ax2.set_ylim(0, 105)
    ax2.grid(True, alpha=0.3)
    ax2.legend(loc="lower left", fontsize=8)
    ax2.set_title("batch-size drift", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = ModelParams(
        ft_hsdp_pause_s=args.ft_hsdp_pause_s,
        gpu_mtbf_s=args.gpu_mtbf_h * HOUR,
        gpus_per_replica=args.gpus_per_replica,
        restart_s=args.restart_min * 60,
        checkpoint_s=args.checkpoint_min * 60,
        recover_pause_s=args.pause_s if args.pause_s is not None else 0.0,  # per size below
        recover_rejoin_pause_s=args.recover_rejoin_pause_s,
        adaptive_pause_s=args.adaptive_timeout_s,
        repair_s=args.repair_min * 60,
        rejoin_pause_s=args.rejoin_pause_s,
        interval=args.interval,
        grad_accum=args.grad_accum,
        recover_overhead=args.recover_overhead,
    )
    wall_s = args.days * DAY
    t0 = time.perf_counter()
    rows: list[JobResult] = []
    inputs: list[dict[str, float]] = []
    for n in sorted(set(args.job_sizes)):
        measured = measured_inputs(n, args)
        inputs.append(measured)
        at_n = dataclasses.replace(params, recover_pause_s=measured["pause_s"], recover_overhead=measured["overhead"])
        try:
            rows.append(simulate_job(n, at_n, wall_s, args.reps, args.seed))
        except ValueError as exc:
            print(f"simulate.py: job size {n}: {exc}", file=sys.stderr)
            return 2
    elapsed = time.perf_counter() - t0

    print(f"Goodput over {args.days:g} days x {args.reps} runs; per-GPU MTBF {args.gpu_mtbf_h:g} h, "
          f"{args.gpus_per_replica} GPUs/replica; CR: R {args.restart_min:g} min, delta {args.checkpoint_min:g} min, "
          f"{args.interval} interval; torchft-like: {args.adaptive_timeout_s:g} s pause, FT-HSDP: "
          f"{args.ft_hsdp_pause_s:g} s, both re-join after {args.repair_min:g} min with a {args.rejoin_pause_s:g} s pause")
    print(f"ReCoVer per job size (fault pause: {args.pause_source} + the bookkeeping of a lost replica's step and "
          f"the re-plan after it; step overhead: a steady step's bookkeeping + the control plane's header and "
          f"agreement, over a {args.step_s:g} s step), bookkeeping fitted from {args.scale_from}:")
    for line in inputs_table(inputs):
        print("  " + line)
    print(f"ReCoVer join pause: {args.recover_rejoin_pause_s:.4g} s ({args.rejoin_pause_source}); "
          + ("re-join: never (--repair-min inf), so both ReCoVer columns are the system without re-join"
             if math.isinf(args.repair_min) else f"a replacement joins {args.repair_min:g} min after a loss"))
    for line in table(rows):
        print(line)
    ci95 = max(max(r.checkpoint_restart.ci95, r.adaptive.ci95, r.recover.ci95, r.recover_no_rejoin.ci95) for r in rows)
    print("CR sim: simulated checkpoint-restart goodput; Daly: its higher-order closed form. torchft-like batch "
          "drift: meanB = mean batch of its steps, minB = smallest batch (both % of the target B), @B = share of "
          "its steps at the full B (ReCoVer: 100% at B by construction). ReCoVer without re-join: lost replicas "
          "never come back (a job without recover.rejoin); with re-join: recover.rejoin=true. "
          f"95% CI half-width of the goodputs <= {ci95:.4f}.")

    result = {
        "benchmark": "simulate",
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "figure", "no_figure", "fits")},
        "fits": {k: list(v) for k, v in args.fits.items()},
        "params_s": params.__dict__,
        "wall_s": wall_s,
        "rows": [r.as_dict() for r in rows],
        "recover_inputs": inputs,
        "elapsed_s": elapsed,
    }
    result["headline"] = last = headline(rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
    print(f"wrote {args.out}")
    if not args.no_figure:
        plot(rows, args.figure, args)
        print(f"wrote {args.figure}")
    print(last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
