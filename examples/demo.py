"""The fault-injection demo: ReCoVer under kills, side by side with its baselines.

Three launched pre-training runs of ``examples/pretrain.py`` (tiny GPT, 4 replicas,
byte-level LM on the interpreter's standard library):

1. **ReCoVer** with two replicas SIGKILLed mid-run (``fault=two_kills``),
2. the same run **fault-free**,
3. the **AdaptiveWorld** ablation (torchft's divide-by-survivors) with the same kills.

It prints a table (final loss, max loss deviation from fault-free, committed samples,
per-fault pause, samples/s), checks the ReCoVer ledger with ``check-ledger`` against the
fault-free one, and writes a PNG figure: loss curves with fault markers, and throughput
per step. Run it from a source checkout as ``python examples/demo.py`` with the package
installed; ``bash examples/demo.sh`` installs it, then runs this script.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = Path(__file__).resolve().with_name("pretrain.py")


@dataclass(frozen=True)
class DemoRun:
    name: str
    label: str
    overrides: tuple[str, ...]


def runs(steps: int) -> list[DemoRun]:
    common = ("model=tiny", f"trainer.max_steps={steps}", "seed=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")
    return [
        DemoRun("recover", "ReCoVer, 2 kills", (*common, "fault=two_kills")),
        DemoRun("fault_free", "fault-free", common),
        DemoRun("adaptive", "AdaptiveWorld, 2 kills", (*common, "fault=two_kills", "recover.policy=adaptive")),
    ]


def launch(run: DemoRun, outdir: Path, nprocs: int, timeout_s: float) -> tuple[float, Path]:
    """One launched job; returns its wall time and its ledger path."""
    rundir = outdir / run.name
    cmd = [
        sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(nprocs), "--",
        sys.executable, str(PRETRAIN), *run.overrides, f"hydra.run.dir={rundir}",
    ]
    print(f"\n=== {run.label}: {' '.join(cmd[6:])}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"{run.label} did not finish in {timeout_s:.0f}s; see {rundir}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wall = time.monotonic() - t0
    ledger = rundir / "ledger.jsonl"
    if not ledger.exists():
        raise RuntimeError(f"{run.label} wrote no ledger (mpiexec exit {rc}); see {rundir}")
    return wall, ledger


def summarize(label: str, ledger: list[dict[str, Any]], reference: list[dict[str, Any]], wall: float, samples_per_mb: int) -> dict[str, Any]:
    ref = {line["step"]: line["loss"] for line in reference}
    dev = max((abs(line["loss"] - ref[line["step"]]) for line in ledger if line["step"] in ref), default=0.0)
    pauses = [p for line in ledger for p in line.get("pauses_s", [])]
    committed = sum(line["committed"] for line in ledger) * samples_per_mb
    train_s = sum(line["step_time_s"] for line in ledger)
    return {
        "run": label, "steps": len(ledger), "final_loss": ledger[-1]["loss"], "max_dev": dev,
        "committed_samples": committed, "faults": sum(len(line["faults"]) for line in ledger),
        "pause_s": sum(pauses) / len(pauses) if pauses else 0.0, "samples_per_s": committed / train_s if train_s else 0.0,
        "wall_s": wall,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'run':<24} {'final loss':>10} {'max |dloss|':>11} {'committed':>10} {'faults':>6} {'pause/fault':>11} {'samples/s':>10} {'wall s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['run']:<24} {r['final_loss']:>10.4f} {r['max_dev']:>11.2e} {r['committed_samples']:>10d} {r['faults']:>6d} "
            f"{r['pause_s'] * 1000:>9.1f}ms {r['samples_per_s']:>10.1f} {r['wall_s']:>7.1f}"
        )
    return "\n".join(lines)


def figure(ledgers: dict[str, list[dict[str, Any]]], labels: dict[str, str], samples_per_mb: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"fault_free": ("black", "-"), "recover": ("tab:blue", "--"), "adaptive": ("tab:red", ":")}
    for name, ledger in ledgers.items():
        color, ls = styles.get(name, ("gray", "-"))
        steps = [line["step"] for line in ledger]
        ax1.plot(steps, [line["loss"] for line in ledger], ls, color=color, lw=2, label=labels[name])
        tput = [line["committed"] * samples_per_mb / line["step_time_s"] for line in ledger]
        ax2.plot(steps, tput, ls, color=color, lw=2, label=labels[name])
        for line in ledger:
            if line["faults"]:
                for ax in (ax1, ax2):
                    ax.axvline(line["step"], color=color, alpha=0.3, lw=1)
                ax1.annotate("kill", (line["step"], line["loss"]), color=color, fontsize=8, xytext=(3, 6), textcoords="offset points")
    ax1.set(xlabel="optimizer step", ylabel="training loss (mean over the step's microbatches)", title="Loss: ReCoVer tracks fault-free")
    ax2.set(xlabel="optimizer step", ylabel="committed samples / s", title="Throughput per step (vertical lines: faults)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/demo", help="directory for the runs, the table and the figure")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (replicas, one shard each)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-run limit in seconds")
    args = ap.parse_args(argv)
    from lightning_recover.audit.ledger import read_ledger
    from lightning_recover.audit.ledger_check import check_ledger

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    samples_per_mb = 4  # examples/conf/data/default.yaml microbatch_size, one shard
    plan = runs(args.steps)
    results: dict[str, tuple[float, list[dict[str, Any]]]] = {}
    for run in plan:
        wall, ledger_path = launch(run, out, args.nprocs, args.timeout)
        results[run.name] = (wall, read_ledger(ledger_path))
    reference = results["fault_free"][1]
    rows = [summarize(run.label, results[run.name][1], reference, results[run.name][0], samples_per_mb) for run in plan]
    verdict = check_ledger(out / "recover" / "ledger.jsonl", reference=str(out / "fault_free" / "ledger.jsonl"), rtol=1e-4)
    figure({r.name: results[r.name][1] for r in plan}, {r.name: r.label for r in plan}, samples_per_mb, out / "demo.png")
    (out / "demo.json").write_text(json.dumps(rows, indent=2))
    print("\n" + table(rows))
    print(f"\nReCoVer ledger vs fault-free: {verdict.summary_line()}")
    print(f"figure: {out / 'demo.png'}   table: {out / 'demo.json'}")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
