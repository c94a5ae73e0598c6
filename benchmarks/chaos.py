"""Chaos campaign: random failures against real launched jobs, every run checked.

``python benchmarks/chaos.py --runs N --seed S`` draws N runs. Each picks a topology that
fits this machine (W replicas x S shards, spares included), then up to W - 1 replica
losses: random victims (contributors, spares, the minor, the replica holding rank 0),
phases (forward, backward, reduce, optimizer), kinds (SIGKILL, SIGSTOP) and timings,
several per step at times, and cascades (a second death during the boundary step of a
first). Every run is checked against the invariants the project promises:

* it finishes within a time bound (a run past it counts as a *hang*);
* the ledger passes ``check-ledger`` (each step commits its B ids exactly once) and its
  loss trajectory matches a fault-free single-process reference (rtol 1e-4);
* every surviving replica holds bitwise-identical parameters;
* every injected fault that fired was recovered (appears in the ledger's faults).

Every run also checks for silent data corruption after each step (``recover.sdc``,
repair): in a run without injected corruption a detection is a *false positive* and a
violation. With ``--corrupt`` every run also gets one ``kind: corrupt`` fault -- a bit flip
in a rank's parameters or optimizer state just before a step's update, or in its
gradients mid-step when a spare shadows it -- which must be detected (an ``sdc`` event in
the ledger, unless the rank died first) and leave the trajectory exact.

With ``--joins`` every run also has hot re-join on (``rejoin=True``): lost replicas are
replaced while the survivors train (every rank sleeps 1 s after each step while replicas
are missing, so a replacement can start on 2 cores), and about half of the lost replicas'
replacements are themselves killed while starting, while receiving the state, or right
after joining (``join_startup`` / ``join_transfer`` / ``joined``, counted by re-join
attempt). The same invariants hold; a replacement that finished the run must hold the
survivors' parameters, and only a replacement killed after joining is a recorded loss.

It is a tool of the checkout, not of the installed package: it trains the example GPT of
``examples/model.py``. Exit status 1 on any violation or hang. ``python benchmarks/chaos.py
job CONFIG`` is the launched job. :func:`reference_run` is the project's one fault-free
reference trajectory; the strategy tests wrap it (``tests/workers/reference.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

#: (replicas, shards, target replicas) that fit a 2-core machine.
TOPOLOGIES: tuple[tuple[int, int, int | None], ...] = ((4, 1, None), (2, 2, None), (5, 1, 4), (3, 1, None), (4, 1, 3))
PHASES = ("forward", "backward", "reduce", "optimizer")
SAMPLES_PER_MICROBATCH = 2
CORPUS_BYTES = 300_000


@dataclass
class ChaosRun:
    index: int
    replicas: int
    shards: int
    target: int | None
    grad_accum: int
    steps: int
    seed: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    rejoin: bool = False

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    @property
    def B(self) -> int:
        return (self.target or self.replicas) * self.grad_accum

    def describe(self) -> str:
        t = f" T={self.target}" if self.target else ""
        fs = ", ".join(f"s{f['step']} r{f['rank']} {f['phase']}{'/mb' + str(f['microbatch']) if 'microbatch' in f else ''} {f['kind']}" for f in self.faults)
        return f"{self.replicas}x{self.shards}{t} G={self.grad_accum} B={self.B}{' rejoin' if self.rejoin else ''}: {fs}"


#: Re-join phases a replacement can be killed in (FaultInjection counts their step by attempt).
JOIN_PHASES = ("join_startup", "join_transfer", "joined")


def draw_run(
    index: int, rng: random.Random, steps: int, hangs: bool = True, stuck: bool = False, joins: bool = False, corrupt: bool = False
) -> ChaosRun:
    """One random run. A fifth of the faults are silent (SIGSTOP, or with ``stuck`` half of
    those spin in compute instead); ``stuck`` does not change the other draws of a seed.
    ``joins`` turns re-join on and adds faults on replacements, ``corrupt`` adds one bit
    flip (both drawn after the others, so the rest of a seed's draw is the same)."""
    W, S, T = rng.choice(TOPOLOGIES)
    run = ChaosRun(index, W, S, T, grad_accum=rng.randint(1, 3), steps=steps, seed=rng.randint(0, 2**31 - 1))
    losses = rng.randint(1, W - 1)
    victims = rng.sample(range(W), losses)
    for n, replica in enumerate(victims):
        rank = replica * S + rng.randrange(S)
        step = rng.randrange(steps)
        phase = rng.choice(PHASES)
        r = rng.random()
        kind = "kill" if not hangs or r >= 0.2 else ("stuck" if stuck and r >= 0.1 else "hang")
        fault: dict[str, Any] = {"step": step, "rank": rank, "phase": phase, "kind": kind}
        if phase in ("forward", "backward"):
            # Indices past the replica's own quota land in a boundary step (a cascade).
            fault["microbatch"] = rng.randrange(run.grad_accum + (2 if n else 0))
        elif phase == "reduce":
            fault["bucket"] = rng.randrange(3)
        run.faults.append(fault)
    if joins:
        run.rejoin = True
        for replica in victims:
            if rng.random() < 0.5:
                rank = replica * S + rng.randrange(S)
                run.faults.append({"step": rng.randint(1, 2), "rank": rank, "phase": rng.choice(JOIN_PHASES), "kind": "kill"})
    if corrupt and run.replicas >= 3:  # two replicas cannot tell which copy is right: that job stops (tested apart)
        rank = rng.randrange(run.world)
        target = rng.choice(("params", "optimizer", "grads"))
        spares = range((run.target or run.replicas) * S, run.world)
        quiet_step0 = not any(f["step"] == 0 for f in run.faults)
        if target == "grads" and run.grad_accum > 1 and spares and quiet_step0:
            # Mid-step, in a spare's shadow copy (the only copy the cross-check compares before the
            # reduction), in step 0, while no failure has changed the roles yet.
            run.faults.append({"step": 0, "rank": rng.choice(list(spares)), "phase": "backward", "microbatch": 1,
                               "kind": "corrupt", "target": "grads"})
        else:
            # A step where at least 3 replicas are certainly live (a majority can name the odd one);
            # the optimizer has no state before its first update (step 0).
            first = 1 if target == "optimizer" else 0
            ok = [t for t in range(first, steps) if run.replicas - sum(1 for f in run.faults if f["step"] <= t) >= 3]
            if ok:
                run.faults.append({"step": rng.choice(ok), "rank": rank, "phase": "optimizer",
                                   "kind": "corrupt", "target": "params" if target == "grads" else target})
    return run


def slow_while_degraded(seconds: float) -> Any:
    """A callback sleeping after each step while replicas are missing: room for a replacement to start on 2 cores."""
    import lightning as L

    class SlowWhileDegraded(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            comm = trainer.strategy.comm
            if len(comm.alive_replicas) < comm.layout.replicas:
                time.sleep(seconds)

    return SlowWhileDegraded()


# ---------------------------------------------------------------------- the launched job
def _examples_on_path() -> None:
    if not (EXAMPLES / "model.py").exists():
        raise FileNotFoundError(f"{EXAMPLES / 'model.py'} not found: the chaos campaign needs a source checkout")
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


def build_tiny(seed: int, corpus_bytes: int = CORPUS_BYTES) -> tuple[Any, Any]:
    """The tiny GPT and its dataset, seeded the same way in every process and in the reference."""
    _examples_on_path()
    import lightning as L
    from model import SIZES, GPT, ByteDataset, read_corpus

    L.seed_everything(seed, verbose=False)
    sizes = dict(SIZES["tiny"])
    return GPT(**sizes, dropout=0.0, warmup_steps=2), ByteDataset(read_corpus(max_bytes=corpus_bytes), sizes["block_size"])


def param_digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(name.encode())
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def job(config_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_recover.callbacks import CorruptionCheck, FaultInjection
    from lightning_recover.strategies import ReCoVerHSDPStrategy

    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    model, data = build_tiny(cfg["seed"])
    strategy = ReCoVerHSDPStrategy(
        shards=cfg["shards"], grad_accum=cfg["grad_accum"], target_replicas=cfg["target"], seed=cfg["seed"],
        ledger_path=out / "ledger.jsonl", bucket_mb=0.01,
        rejoin=cfg.get("rejoin", False), rejoin_backoff_s=0.5, rejoin_timeout_s=60.0,
        sdc_every_n_steps=1, sdc_action="repair",
    )
    slow = [slow_while_degraded(1.0)] if cfg.get("rejoin") else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=cfg["steps"], callbacks=[FaultInjection(cfg["faults"]), *slow],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0, num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=SAMPLES_PER_MICROBATCH // cfg["shards"]))
    comm = strategy.comm
    assert comm is not None
    with strategy.replica_guard("final parameter gather"):
        digest = param_digest(model)
    if comm.shard == 0:
        sdc = next(cb for cb in trainer.callbacks if isinstance(cb, CorruptionCheck))
        (out / f"rank{comm.rank}.json").write_text(json.dumps(
            {"rank": comm.rank, "replica": comm.replica, "digest": digest, "sdc_checks": sdc.checks, "sdc_detections": sdc.detections}
        ))
    strategy.shutdown(exit_code=0)


# ---------------------------------------------------------------------- reference
_REFERENCE: dict[tuple[int, int, int, int], tuple[list[float], dict[str, Any]]] = {}


def reference_run(B: int, steps: int, seed: int, samples_per_microbatch: int = SAMPLES_PER_MICROBATCH) -> tuple[list[float], dict[str, Any]]:
    """One process accumulating the same B microbatches per step: the trajectory every
    fault-tolerant run must reproduce. Returns per-step losses and the final parameters."""
    key = (B, steps, seed, samples_per_microbatch)
    if key in _REFERENCE:
        return _REFERENCE[key]
    import torch

    from lightning_recover.planner import MicrobatchPlanner

    torch.set_num_threads(1)
    model, data = build_tiny(seed)
    planner = MicrobatchPlanner(len(data), B, samples_per_microbatch, shards=1, seed=seed)
    cfg = model.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    model.log = lambda *a, **k: None
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for offset in range(B):
            gid = planner.global_id(step, offset)
            torch.manual_seed(planner.rng_seed(gid, 0))
            idx = planner.sample_indices(gid, 0)
            batch = (torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx]))
            loss = model.training_step(batch, 0)
            (loss / B).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(total / B)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    _REFERENCE[key] = (losses, params)
    return losses, params


# ---------------------------------------------------------------------- driver
@dataclass
class Outcome:
    run: ChaosRun
    seconds: float
    hang: bool = False
    fired: int = 0
    recovered: int = 0
    violations: list[str] = field(default_factory=list)
    pauses: list[float] = field(default_factory=list)
    #: Per step that lost a hung or stuck replica: the longest failed round, i.e. how long the
    #: survivors were blocked before the watchdog's kill freed them.
    detects: list[float] = field(default_factory=list)
    #: Corruption checks run and detections, summed over the ranks that finished.
    sdc_checks: int = 0
    sdc_detections: int = 0
    #: Injected corruptions that fired, and how many of them the ledger shows detected.
    corruptions: int = 0
    corruptions_found: int = 0


def execute(run: ChaosRun, outdir: Path, hang_timeout: float, bound_s: float) -> Outcome:
    from lightning_recover.launcher import RUNTIME_START_FAILURE, build_command, launch_env, run_supervised
    from lightning_recover.ledger import LedgerWriter, check_ledger, read_ledger

    if outdir.exists():
        shutil.rmtree(outdir)  # a result file left by an earlier campaign must never count as a survivor
    outdir.mkdir(parents=True)
    cfg = {**asdict(run), "out": str(outdir)}
    (outdir / "config.json").write_text(json.dumps(cfg))
    argv = build_command(run.world, [sys.executable, str(Path(__file__).resolve()), "job", str(outdir / "config.json")])
    env = launch_env()
    env["LIGHTNING_RECOVER_HANG_TIMEOUT"] = f"{hang_timeout:g}"
    # The job imports the package from this checkout even where it is not installed.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    t0 = time.monotonic()
    hang = False
    for _ in range(2):
        with open(outdir / "job.log", "w") as logf:
            try:
                run_supervised(argv, env, nprocs=run.world, timeout_s=bound_s, stdout=logf, stderr=subprocess.STDOUT)
            except subprocess.TimeoutExpired:
                hang = True
        if hang or RUNTIME_START_FAILURE not in (outdir / "job.log").read_text(errors="replace") or (outdir / "ledger.jsonl").exists():
            break
        # Open MPI's runtime did not come up (no rank ran): not a recovery failure; run it again once.
        print(f"[{run.index + 1}] Open MPI's runtime failed to start; launching the run once more", flush=True)
    out = Outcome(run, time.monotonic() - t0, hang=hang)
    if hang:
        out.violations.append(f"did not finish within {bound_s:.0f}s")
        return out
    ledger_path = outdir / "ledger.jsonl"
    if not ledger_path.exists():
        out.violations.append("no ledger written")
        return out
    ledger = read_ledger(ledger_path)
    ref_path = outdir / "reference.jsonl"
    with LedgerWriter(ref_path) as ref:
        for step, loss in enumerate(reference_run(run.B, run.steps, run.seed)[0]):
            ids = list(range(step * run.B, (step + 1) * run.B))
            ref.write({"step": step, "loss": loss, "B": run.B, "committed": run.B, "microbatch_ids": ids, "replicas": [],
                       "world_epoch": 0, "roles": {}, "faults": [], "extra_microbatches": 0, "step_time_s": 0.0, "recovery_s": 0.0})
    verdict = check_ledger(ledger_path, reference=str(ref_path), rtol=1e-4)
    if not verdict.ok:
        out.violations.append(verdict.summary_line())
    if len(ledger) != run.steps:
        out.violations.append(f"ledger has {len(ledger)} steps, expected {run.steps}")
    lost = sorted({r for line in ledger for r in line["faults"]})
    log_text = (outdir / "job.log").read_text(errors="replace")
    hit = [f for f in run.faults if f"{f['kind']} rank {f['rank']} at step {f['step']} {f['phase']}" in log_text]
    corrupted = [f for f in hit if f["kind"] == "corrupt"]
    hit = [f for f in hit if f["kind"] != "corrupt"]
    # A death between the last commit and the end of training is in no step's faults.
    late = {f["rank"] // run.shards for f in hit if f["step"] == run.steps - 1 and f["phase"] == "optimizer"}
    # A replacement killed before it was admitted was never a member the ledger counts.
    fired = sorted({f["rank"] // run.shards for f in hit if f["phase"] not in ("join_startup", "join_transfer")})
    out.fired, out.recovered = len(fired), len(set(fired) & (set(lost) | late))
    if set(fired) - set(lost) - late:
        out.violations.append(f"replicas {sorted(set(fired) - set(lost) - late)} were hit but not recorded as lost")
    survivors = {}
    for f in outdir.glob("rank*.json"):
        res = json.loads(f.read_text())
        survivors[res["replica"]] = res["digest"]
        out.sdc_checks += res.get("sdc_checks", 0)
        out.sdc_detections += res.get("sdc_detections", 0)
    events = [e for line in ledger for e in line.get("sdc", [])]
    out.corruptions, out.corruptions_found = len(corrupted), min(len(corrupted), len(events))
    if events and not corrupted:
        out.violations.append(f"false positive: {len(events)} corruption event(s) in a run without injected corruption: {events}")
    for f in corrupted:
        # Found unless the corrupted rank's replica was lost before the check could see it.
        if not events and f["rank"] // run.shards not in lost:
            out.violations.append(f"corruption of rank {f['rank']} ({f['target']}) at step {f['step']} was not detected")
    alive = (set(ledger[-1]["replicas"]) if ledger else set()) - late
    if set(survivors) != alive:
        out.violations.append(f"survivor results from replicas {sorted(survivors)} but the ledger ends with {sorted(alive)}")
    if len(set(survivors.values())) > 1:
        out.violations.append("surviving replicas hold different parameters")
    out.pauses = [p for line in ledger for p in line.get("pauses_s", [])]
    hung = {f["rank"] // run.shards for f in hit if f["kind"] in ("hang", "stuck")}
    out.detects = [max(line["detects_s"]) for line in ledger if hung & set(line["faults"]) and line.get("detects_s")]
    return out


def campaign(
    runs: int, seed: int, outdir: Path, steps: int, hang_timeout: float, bound_s: float, hangs: bool = True, stuck: bool = False,
    joins: bool = False, corrupt: bool = False,
) -> list[Outcome]:
    rng = random.Random(seed)
    outcomes = []
    for i in range(runs):
        run = draw_run(i, rng, steps, hangs=hangs, stuck=stuck, joins=joins, corrupt=corrupt)
        res = execute(run, outdir / f"run{i:04d}", hang_timeout, bound_s)
        outcomes.append(res)
        status = "OK" if not res.violations else "VIOLATION: " + "; ".join(res.violations)
        print(f"[{i + 1}/{runs}] {run.describe()} -> {res.recovered}/{res.fired} recovered in {res.seconds:.0f}s {status}", flush=True)
    return outcomes


def summary(outcomes: list[Outcome]) -> str:
    faults = sum(len(o.run.faults) for o in outcomes)
    fired = sum(o.fired for o in outcomes)
    recovered = sum(o.recovered for o in outcomes)
    violations = sum(1 for o in outcomes if o.violations and not o.hang)
    hangs = sum(1 for o in outcomes if o.hang)
    pauses = sorted(p for o in outcomes for p in o.pauses)
    med = pauses[len(pauses) // 2] if pauses else float("nan")
    detects = sorted(d for o in outcomes for d in o.detects)
    rows = [
        ("runs", len(outcomes)), ("faults scheduled", faults), ("faults injected (fired)", fired),
        ("recovered", recovered), ("violations", violations), ("hangs", hangs),
        ("median recovery pause", f"{med:.3f}s"),
        ("corruption checks (all ranks)", sum(o.sdc_checks for o in outcomes)),
        ("corruptions injected / detected", f"{sum(o.corruptions for o in outcomes)} / {sum(o.corruptions_found for o in outcomes)}"),
        ("sdc false positives", sum(1 for o in outcomes if any(v.startswith("false positive") for v in o.violations))),
    ]
    if detects:
        rows.append(("silent-fault detection", f"n={len(detects)} median {detects[len(detects) // 2]:.2f}s max {detects[-1]:.2f}s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:
        job(argv[1])
        return 0
    # The driver (never a launched rank): orphans of a run re-parent to it instead of pid 1;
    # run_supervised ends each run's ranks by pid (mpiexec gives each its own process group).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from proctree import become_subreaper

    become_subreaper()
    ap = argparse.ArgumentParser(prog="python benchmarks/chaos.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    ap.add_argument("--out", default="runs/chaos", help="directory for per-run logs and ledgers")
    ap.add_argument("--hang-timeout", type=float, default=3.0, help="watchdog timeout for SIGSTOPped ranks")
    ap.add_argument("--bound", type=float, default=240.0, help="a run longer than this counts as a hang")
    ap.add_argument("--no-hangs", action="store_true", help="inject SIGKILLs only")
    ap.add_argument("--stuck", action="store_true", help="half of the silent faults spin in compute instead of SIGSTOP")
    ap.add_argument("--corrupt", action="store_true", help="one bit-flip corruption per run (silent data corruption)")
    ap.add_argument("--joins", action="store_true", help="hot re-join on, and faults on the replacements (needs --steps >= 30)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    if args.joins and args.steps < 30:
        ap.error(f"--joins needs --steps >= 30 (a replacement takes seconds to start), got {args.steps}")
    outcomes = campaign(
        args.runs, args.seed, Path(args.out), args.steps, args.hang_timeout, args.bound, hangs=not args.no_hangs, stuck=args.stuck,
        joins=args.joins, corrupt=args.corrupt,
    )
    print(summary(outcomes))
    bad = any(o.violations for o in outcomes)
    print(f"chaos: {'FAILED' if bad else 'OK'}: {len(outcomes)} runs, {sum(1 for o in outcomes if o.violations)} with violations")
    return 1 if bad else 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:  # run from a fresh clone without installing the package
        sys.path.insert(0, str(REPO))
    sys.exit(main())
