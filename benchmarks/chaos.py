"""Chaos campaign: random failures against real launched jobs, every run checked.

``python -m benchmarks.chaos --runs N --seed S`` draws N runs. Each picks a topology that
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

With ``--terms`` half of the kills are SIGTERMs (mpiexec ending ranks, a node drained),
which the strategy turns into an immediate death: the same invariants hold.

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
With ``--standbys N`` as well, the leader keeps N warm standbys, so the replacements (and
the faults drawn for them) are standbys seated on the lost replicas. A seat keeps the
attempt number of the next attempt the survivors start, so a ``join_startup`` fault fires
in every standby seated for it, like a node on which every replacement dies at start-up:
after ``rejoin.attempts`` such deaths in a row the job falls back to cold spawns.

With ``--hosts N`` (N >= 2, root: fake hosts in network namespaces,
:mod:`benchmarks.rigs.fake_cluster`) every run goes onto up to N fake hosts
built once for the campaign, with Open MPI's heartbeat detector on (period 1 s, timeout
4 s, without its thread), and gets one **host fault** on a host other than the head
(where mpiexec runs): ``host_ranks_kill`` (all its ranks, the daemon lives), ``host_kill``
(the whole host, Open MPI's daemon with it), ``host_freeze`` (every process SIGSTOPped),
``host_partition`` (its link down for good) or ``host_flap`` (down 2-6 s, then up), mixed
with a rank fault elsewhere in most runs (kill, or a SIGSTOP on a host where another rank
runs, whose watchdog kills it). With ``--two-host-faults P`` (N >= 3) that fraction of the
runs whose first host fault leaves the job in place gets a second host fault on another host
(all its ranks killed, frozen or cut off) in a later step. FaultInjection asks for the host fault when the named rank
reaches the point; the campaign's harness
(:class:`benchmarks.rigs.host_faults.HostFaultHarness`) applies it. Every run is
launched as a user on a cluster would launch it: ``lightning-recover launch --supervise``
over the hosts, a checkpoint after every step, ``--stall-timeout`` :data:`STALL_TIMEOUT_S`,
every agreement and repair bounded by :data:`REPAIR_BOUND_S`
(``LIGHTNING_RECOVER_REPAIR_TIMEOUT``). Where the job cannot go on in place the supervisor
relaunches it from the newest checkpoint on the hosts it can still reach (the ssh
stand-in refuses a cut-off host and never answers for a frozen one, as ssh would); the
relaunch runs without faults. Each run's outcome is predicted with the no-split-brain rule
(:mod:`lightning_recover.comm.quorum`, the same inputs the survivors have) and checked:

* it ends within the bound (else a *hang*), with the launcher's status 0, every step in
  the ledger once and exact against the fault-free reference (every attempt's ledger, as
  the attempt left it, too), and the last world's replicas bitwise identical;
* **split brain** (counted apart): two ledger lines for one step, a rank outside the last
  world that finished (a result file or an ``ok`` marker), or a rank of a relaunched
  attempt that finished while a later attempt committed steps -- two sides trained (a
  relaunch that found every step committed trained nothing: counted apart as "relaunches
  that found the job finished");
* when the rule lets the head's side go on: it goes on in place, the last world is the
  predicted one (a flap may also heal before anybody noticed: then nobody is lost), and
  every rank of a cut-off host left with an ``exited`` marker starting "no quorum"; or, the
  one exception, an agreement or repair Open MPI never returned from was cut short by its
  bound (the markers say "did not finish within") and the relaunch finished the job;
* when the rule lets no side go on: every rank of the head's side left with the "no
  quorum" marker, and the supervisor relaunched (a stop while mpiexec waits on a frozen
  or cut-off host's daemon ends by the stall timeout);
* a host lost with its daemon: Open MPI 5.0.x aborts the whole job; the supervisor names
  the lost host and relaunches on the others.

With ``--hosts N --joins`` (N >= 3, ``--steps`` >= 20; ``--standbys K`` too) re-join is on
and the job fills hosts 0 and 1, leaving host 2 spare: the launcher names it in
``LIGHTNING_RECOVER_SPARE_HOSTS`` and replacements (and standbys) are placed there
(:mod:`lightning_recover.membership.placement`). Each run
(:func:`benchmarks.rigs.campaign.draw_host_join_run`) loses host 1's replicas early
(all its ranks killed, frozen, cut off, or lost with the daemon; on one-slot hosts also its
lone rank SIGSTOPped, with no watchdog beside it), faults the first re-join attempt in about
half the runs (the replacement killed, or the spare host's ranks killed, frozen -- during
the state transfer too --, cut off or lost while the replacement starts, is fed the state or
has just joined), and in about 40% loses the spare host again late in the run (two host
faults in one run). The summary counts each of these draw kinds when it fired. Verdicts are
those below (exact ledger in every attempt, no split brain, bounded end with status 0), with
the last world held to contain the head host's replicas (the lost ones may be back). A
relaunch is accepted where a host was lost with its daemon, an agreement never returned
(bounded), or -- new with re-join -- a replacement was frozen or cut off with its host: Open
MPI's heartbeat detector watches only the launch's own world (a ring over MPI_COMM_WORLD),
never a spawn's, so nobody declares such a replacement dead and the supervisor's stall
timeout ends the job and relaunches it (``relaunched by the supervisor`` names the cause).

With ``--salvage`` (issue 37) salvage is on: on one machine (``--steps`` >= 30) the runs draw
from replicas of 2 shards, so that a lost rank leaves an orphan, and with ``--joins`` the
replacement faults also hit seated orphans and the ranks they spawn. With ``--hosts N
--salvage`` (N >= 3, re-join on,
:func:`benchmarks.rigs.campaign.draw_host_salvage_run`) a 2 x 2 job on hosts 0 and 1
loses one rank of host 1 early: its mate waits as an orphan and spawns the missing rank onto
the spare host, and in about half the runs a host fault later hits that replica (spanning
hosts 1 and 2) on one of its hosts. The summary counts what salvage did (replicas re-formed
from orphans alone, completed by spawned ranks, orphans dismissed unseated).

Draws left out on purpose, and why: the head host is never a victim (losing it loses the
job on any cluster); a cut where the rule lets the cut-off side go on instead of the
head's (legal, but the cut-off side's daemon then answers to an mpiexec it cannot reach:
no launcher can report that world's end); and, without ``--joins``, a rank SIGSTOPped alone
on its host (no watchdog beside it; ``--hosts N --joins`` draws it on one-slot hosts, in a
world of two ranks): left to Open MPI's detector, one survivor learnt of the failure and
another never did ("ranks known dead: not yet known"), no repair began, and the job hung
until it was killed -- seen 3 times here (the leader alone on the head host twice, 120 s
and 150 s, ``LIGHTNING_RECOVER_REPAIR_TIMEOUT=40`` not ending it, so before the repair;
rank 1 alone on host 1 stopped in the optimizer phase once, 150 s), while rank 2 alone on
host 2 stopped in forward recovered in 19 s.

Open MPI's agreement that never returns (2026-12-02, pip Open MPI 5.0.11): host 1 of 3
partitioned or frozen while the world is 3 one-rank replicas on 3 hosts: the majority's
two ranks never repair; one says "ranks known dead: [1]", the other "not yet known", and
both wait for good in the agreement that precedes the repair (py-spy:
``FaultTolerantComm.agree``, ``self.world.Agree``, from
``StepEngine.reduce_until_committed``). Before agreements were bounded, ``--hosts 3
--runs 20 --seed 7 --steps 4`` had 2 such hangs in 20 runs; now the bound ends those ranks
and the supervisor relaunches the job from its checkpoint.

It is a tool of the checkout, not of the installed package: it trains the example GPT of
``examples/model.py``. Exit status 1 on any violation or hang. ``python -m benchmarks.chaos
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
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

# What the campaign draws and how it judges (shared with the tests, which check that very code).
from benchmarks.rigs.campaign import (  # noqa: E402
    CUT_OFF_EXIT_BOUND_S,
    DETECTOR,
    REPAIR_BOUND_S,
    SALVAGE_EVENTS,
    STALL_TIMEOUT_S,
    ChaosRun,
    Outcome,
    Prediction,
    read_attempts,
    draw_host_join_run,
    draw_host_salvage_run,
    draw_host_run,
    draw_run,
    join_draw_kinds,
    last_relaunch_idle,
    summary,
    supervisor_lines,
)

SAMPLES_PER_MICROBATCH = 2
CORPUS_BYTES = 300_000


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
def build_tiny(seed: int, corpus_bytes: int = CORPUS_BYTES) -> tuple[Any, Any]:
    """The tiny GPT and its dataset, seeded the same way in every process and in the reference."""
    import lightning as L
    from examples.model import SIZES, GPT, ByteDataset, read_corpus

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


#: What the supervisor appends to the job's command when it relaunches from a checkpoint (runs on fake hosts).
RESUME_ARG = "--resume"


def job(config_path: str, resume: bool = False) -> None:
    """One rank of a run. Runs on fake hosts are supervised (``supervised`` in the config): a
    checkpoint after every step, and a relaunch (``resume``) continues from the newest one
    with no faults (they were the first attempt's); the ledger the earlier attempt left is
    first copied to ``ledger.attempt-K.jsonl``, as the judge's record of that attempt."""
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_recover.callbacks import CorruptionCheck, FaultInjection
    from lightning_recover.callbacks.checkpoint import fallback_checkpoint, resolve_ckpt_path
    from lightning_recover.cli.launcher import ENV_ATTEMPT
    from lightning_recover.strategies import ReCoVerHSDPStrategy

    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    attempt = int(os.environ.get(ENV_ATTEMPT, "0"))
    supervised = bool(cfg.get("supervised"))
    if attempt and os.environ.get("OMPI_COMM_WORLD_RANK") == "0" and (out / "ledger.jsonl").exists():
        shutil.copyfile(out / "ledger.jsonl", out / f"ledger.attempt-{attempt - 1}.jsonl")
    model, data = build_tiny(cfg["seed"])
    ckpt_dir = out / "checkpoints"
    strategy = ReCoVerHSDPStrategy(
        shards=cfg["shards"], grad_accum=cfg["grad_accum"], target_replicas=None if resume else cfg["target"], seed=cfg["seed"],
        ledger_path=out / "ledger.jsonl", bucket_mb=0.01,
        rejoin=cfg.get("rejoin", False), rejoin_backoff_s=0.5, rejoin_timeout_s=60.0, rejoin_standbys=cfg.get("standbys", 0),
        salvage=cfg.get("salvage", False), salvage_wait_s=60.0,
        sdc_every_n_steps=1, sdc_action="repair",
        # Written in the foreground: a relaunch must find the step's checkpoint complete.
        **({"checkpoint_dir": ckpt_dir, "checkpoint_every_n_steps": 1, "checkpoint_async_save": False} if supervised else {}),
    )
    slow = [slow_while_degraded(1.0)] if cfg.get("rejoin") or cfg.get("salvage") else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=cfg["steps"],
        callbacks=[FaultInjection(cfg["faults"] if attempt == 0 else []), *slow, *([fallback_checkpoint(ckpt_dir, 1)] if supervised else [])],
        logger=False, enable_checkpointing=supervised, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0, num_sanity_val_steps=0, default_root_dir=str(out),
    )
    ckpt_path = resolve_ckpt_path("last", ckpt_dir) if resume else None
    trainer.fit(model, DataLoader(data, batch_size=SAMPLES_PER_MICROBATCH // cfg["shards"]), ckpt_path=ckpt_path)
    comm = strategy.comm
    assert comm is not None
    with strategy.replica_guard("final parameter gather"):
        digest = param_digest(model)
    if comm.shard == 0:
        sdc = next(cb for cb in trainer.callbacks if isinstance(cb, CorruptionCheck))
        name = f"rank{comm.rank}.json" if not supervised else f"rank{comm.rank}.attempt-{attempt}.json"
        (out / name).write_text(json.dumps(
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

    from lightning_recover.workload.planner import MicrobatchPlanner

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

def execute(run: ChaosRun, outdir: Path, hang_timeout: float, bound_s: float) -> Outcome:
    from lightning_recover.audit.ledger import read_ledger
    from lightning_recover.audit.ledger_check import check_ledger
    from lightning_recover.audit.ledger_writer import LedgerWriter
    from lightning_recover.cli.mpiexec import build_command, launch_env
    from lightning_recover.cli.runner import RUNTIME_START_FAILURE, run_supervised

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
    out.salvage_events = [event for event, line in SALVAGE_EVENTS.items() if line in log_text]
    return out


def _write_reference(run: ChaosRun, path: Path, steps: int) -> None:
    from lightning_recover.audit.ledger_writer import LedgerWriter

    with LedgerWriter(path) as ref:
        for step, loss in enumerate(reference_run(run.B, run.steps, run.seed)[0][:steps]):
            ids = list(range(step * run.B, (step + 1) * run.B))
            ref.write({"step": step, "loss": loss, "B": run.B, "committed": run.B, "microbatch_ids": ids, "replicas": [],
                       "world_epoch": 0, "roles": {}, "faults": [], "extra_microbatches": 0, "step_time_s": 0.0, "recovery_s": 0.0})




def execute_on_hosts(
    run: ChaosRun, pred: Prediction, outdir: Path, cluster: Any, harness: Any, bound_s: float, hang_timeout: float
) -> Outcome:
    """Launch ``run`` supervised on the fake hosts, let the harness apply its host fault, and judge every
    attempt against ``pred`` (module docstring)."""
    from lightning_recover.audit.ledger import LedgerFormatError, read_ledger
    from lightning_recover.audit.ledger_check import check_ledger

    if outdir.exists():
        shutil.rmtree(outdir)  # a result file left by an earlier campaign must never count as a survivor
    outdir.mkdir(parents=True)
    cfg = {**asdict(run), "target": None, "out": str(outdir), "supervised": True}
    (outdir / "config.json").write_text(json.dumps(cfg))
    harness.reset(outdir / "host-faults")
    supervise = [
        "--supervise", "--checkpoint-dir", str(outdir / "checkpoints"), "--ledger", str(outdir / "ledger.jsonl"),
        "--status-dir", str(outdir / "status"), "--max-relaunches", "2", "--relaunch-backoff", "0.5",
        f"--resume-arg={RESUME_ARG}", "--replica-size", str(run.shards), "--stall-timeout", f"{STALL_TIMEOUT_S:g}",
    ]
    argv = cluster.launcher_argv(
        run.world, [sys.executable, str(Path(__file__).resolve()), "job", str(outdir / "config.json")], extra=DETECTOR, cwd=REPO,
        launcher_options=supervise, slots=run.slots, hosts=run.hosts,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env.update(harness.env(), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    # The watchdog kills a stopped rank from beside it on its host (as in the one-machine campaign);
    # Open MPI's detector finds what no watchdog can see (a frozen or cut-off host).
    env["LIGHTNING_RECOVER_HANG_TIMEOUT"] = f"{hang_timeout:g}"
    env["LIGHTNING_RECOVER_REPAIR_TIMEOUT"] = f"{REPAIR_BOUND_S:g}"
    t0 = time.monotonic()
    hang = False
    # The launcher's output goes to a file: a cut-off host's daemon outlives mpiexec and would hold a pipe.
    with open(outdir / "job.log", "w") as logf:
        proc = subprocess.Popen(argv, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            hang = True
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # the launcher forwards it to mpiexec's session
                proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        finally:
            if not hang:
                _let_cut_off_ranks_leave(cluster, harness)
            cluster.kill_everything()  # what outlived the job: a frozen host's or a cut-off host's processes
            harness.restore()  # links up, frozen hosts thawed, lost hosts back: the next run gets whole hosts
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    out = Outcome(run, time.monotonic() - t0, hang=hang)
    out.host_faults = [f"{a.kind} {a.host} ranks {a.ranks}" if a.error is None else f"{a.kind}: {a.error}" for a in harness.applied]
    bad = [a.error for a in harness.applied if a.error is not None]
    if bad:
        out.violations.append("host fault not applied: " + "; ".join(bad))
    if hang:
        out.violations.append(f"did not finish within {bound_s:.0f}s")
        return out
    log_text = (outdir / "job.log").read_text(errors="replace")
    out.salvage_events = [event for event, line in SALVAGE_EVENTS.items() if line in log_text]
    attempts = read_attempts(outdir)
    if not attempts:
        out.violations.append("the supervisor left no attempt's status directory")
        return out
    first, final = attempts[0], attempts[-1]
    out.relaunches = len(attempts) - 1
    reasons = [line for line in supervisor_lines(log_text) if "; relaunch " in line]

    # Every attempt: its ledger exact against the fault-free reference, and never two sides training.
    ledgers: list[list[dict[str, Any]]] = []
    for a in attempts:
        try:
            ledger = read_ledger(a.ledger_path) if a.ledger_path.exists() else []
        except (OSError, LedgerFormatError) as exc:  # e.g. two writers' lines run together
            out.violations.append(f"attempt {a.index + 1}: the ledger cannot be read: {exc}")
            ledger = []
        ledgers.append(ledger)
        steps = [line["step"] for line in ledger]
        twice = sorted({t for t in steps if steps.count(t) > 1})
        if twice:
            out.split_brain.append(f"attempt {a.index + 1}: two ledger lines for step(s) {twice}")
        if ledger:
            ref = outdir / f"reference.{a.index}.jsonl"
            _write_reference(run, ref, max(steps) + 1)
            verdict = check_ledger(a.ledger_path, reference=str(ref), rtol=1e-4)
            if not verdict.ok:
                out.violations.append(f"attempt {a.index + 1}: {verdict.summary_line()}")
        if a.markers["raised"]:
            # A host fault must end a rank by death, the gate or the quorum rule, never by an exception.
            out.violations.append(f"attempt {a.index + 1}: rank(s) raised: " + "; ".join(
                f"{r}: {t.splitlines()[-1] if t else '?'}" for r, t in sorted(a.markers["raised"].items())))
    for a in attempts[:-1]:
        finished = sorted(set(a.results) | set(a.markers["ok"]))
        # An attempt whose ranks finished was relaunched anyway: a split brain if a later attempt
        # trained again (two worlds committing steps). A relaunch that found every step committed
        # trained nothing -- the race of mpiexec's abort with the survivors' last step, which the
        # supervisor narrows (launcher.settled_markers) but cannot close; counted apart.
        later = [t for lg in ledgers[a.index + 1:] for t in lg]
        if finished and later:
            out.split_brain.append(f"attempt {a.index + 1} was relaunched, yet rank(s) {finished} of it finished and "
                                   f"a later attempt committed step(s) {sorted({t['step'] for t in later})}")
        elif finished:
            out.idle_relaunches += 1
    ledger = ledgers[-1]
    last = set(ledger[-1]["replicas"]) if ledger else set()
    # The same race in the last attempt: its ranks must still agree with each other (below).
    idle_final = last_relaunch_idle([len(lg) for lg in ledgers], run.steps)
    if idle_final:
        out.idle_relaunches += 1

    # The end the user sees: every step committed once, the survivors identical, status 0.
    if proc.returncode != 0:
        out.violations.append(f"the launcher's status is {proc.returncode}, expected 0 (the job finishes, in place or relaunched)")
    if len(ledger) != run.steps:
        out.violations.append(f"the ledger has {len(ledger)} steps, expected {run.steps}")
    outsiders = sorted(r for r in set(final.results) | set(final.markers["ok"]) if r // run.shards not in last)
    if outsiders and not idle_final:
        out.split_brain.append(f"rank(s) {outsiders} outside the last world {sorted(last)} finished (results or ok markers)")
    if {r // run.shards for r in final.results} != last and not (idle_final and final.results):
        out.violations.append(f"survivor results from ranks {sorted(final.results)} but the ledger ends with replicas {sorted(last)}")
    if len({res['digest'] for res in final.results.values()}) > 1:
        out.violations.append("surviving replicas hold different parameters")

    # The first attempt against the rule's prediction.
    bounded = sorted(r for r, text in first.markers["exited"].items() if text.startswith("no quorum") and "did not finish within" in text)
    no_quorum = sorted(r for r, text in first.markers["exited"].items() if text.startswith("no quorum"))
    if pred.flap and out.relaunches and not bounded:
        # Open MPI's detector ring may cost any part of the world after a flap, all of it too: ranks
        # declared dead across the cut are aborted once they hear of it, their mates leave through the
        # gate, or the head's side stops for want of quorum. The relaunch goes on, exact (checked above).
        pred = Prediction(False, pred.final, stopped=frozenset(no_quorum), flap=True)
    if pred.host_lost:
        victim = next((a.host for a in harness.applied if a.kind == "host_kill" and a.error is None), None)
        if not out.relaunches:
            # The survivors finished before Open MPI's abort reached them: in place, as the rule says.
            if not pred.proceeds:
                out.violations.append("the rule stops the head's side after the host loss, yet the job finished without a relaunch")
            elif frozenset(last) not in pred.final:
                out.violations.append(f"the last world is {sorted(last)}, the rule predicts {sorted(pred.final[0])}")
        elif victim is not None and not any(victim in _named_lost(line) for line in reasons[:1]):
            out.violations.append(f"the supervisor's relaunch does not name the lost host {victim}: {reasons[:1]}")
    elif pred.proceeds:
        if out.relaunches:
            out.bounded = bool(bounded)
            out.unwatched = bool(pred.rejoin and not bounded and _unwatched_stall(run, harness, reasons))
            if not bounded and not out.unwatched:
                # In place was possible; only an agreement the MPI never returned from may end it, or (with
                # re-join) a silent fault of a replacement, which no failure detector watches.
                out.violations.append(f"relaunched although the rule lets the head's side go on in place: {reasons[:1]}")
        elif pred.rejoin:
            # Replicas lost may be back through re-join (or not, if every attempt failed): never-hit ones must be there.
            if not pred.final[0] <= last or not last <= set(range(run.replicas)):
                out.violations.append(f"the last world is {sorted(last)}: it must hold the head's replicas {sorted(pred.final[0])}")
        elif pred.flap:
            if not last or not last <= pred.final[0]:
                out.violations.append(f"after the flap the last world is {sorted(last)}, not a part of {sorted(pred.final[0])}")
        elif frozenset(last) not in pred.final:
            out.violations.append(f"the last world is {sorted(last)}, the rule predicts {' or '.join(str(sorted(f)) for f in pred.final)}")
        # A flap's lost ranks may also have been aborted by Open MPI itself (declared dead, then
        # told so once the link was back): only a partition's are held to the marker.
        for a in (a for a in harness.applied if a.kind == "host_partition" and not _from_replacement(run, harness, a)):
            left = [r for r in a.ranks if out.relaunches or r // run.shards not in last]
            quiet = [r for r in left if not first.markers["exited"].get(r, "").startswith("no quorum")]
            if quiet:
                out.violations.append(
                    f"cut-off rank(s) {quiet} on {a.host} did not leave with the no-quorum marker within {CUT_OFF_EXIT_BOUND_S:g}s of the cut"
                )
            out.cut_off_left += len(left) - len(quiet)
    else:
        out.no_quorum = bool(no_quorum)
        if not out.relaunches:
            out.violations.append("the rule lets no side go on, yet the job was not relaunched")
        quiet = sorted(r for r in pred.stopped if not first.markers["exited"].get(r, "").startswith("no quorum"))
        if quiet:
            out.violations.append(f"rank(s) {quiet} of the head's side did not leave with the no-quorum marker")
    if out.relaunches:
        out.relaunch_cause = (
            "the host's daemon lost" if pred.host_lost else "an agreement that never returned (bounded)" if out.bounded
            else "a replacement stopped where no detector watches it (stall timeout)" if out.unwatched
            else "no quorum (by the rule)" if out.no_quorum else "the flap cost every replica" if pred.flap else "?"
        )
        # The relaunch ran no faults: all of its ranks form the last world -- unless it found every
        # step committed and wrote no ledger line (idle_final): the ledger's last world is then the
        # first attempt's, and the relaunch's ranks are held to identical parameters above.
        started = {r // run.shards for r in final.markers["started"]}
        if started != last and not idle_final:
            out.violations.append(f"the relaunch started replicas {sorted(started)} but its last world is {sorted(last)}")
        out.relaunch_costs = [line.partition("cost ")[2] for line in supervisor_lines(log_text) if " cost " in line]

    hit = [f for f in run.faults if not f["kind"].startswith("host_") and f"{f['kind']} rank {f['rank']} at step {f['step']} {f['phase']}" in log_text]
    # Every step of every run is also checked for silent data corruption: none was injected here.
    results = [res for a in attempts for res in a.results.values()]
    out.sdc_checks = sum(res.get("sdc_checks", 0) for res in results)
    out.sdc_detections = sum(res.get("sdc_detections", 0) for res in results)
    events = [e for lg in ledgers for line in lg for e in line.get("sdc", [])]
    if events:
        out.violations.append(f"false positive: {len(events)} corruption event(s) in a run without injected corruption: {events}")
    if run.rejoin:
        done = {(a.rank, a.step, a.phase) for a in harness.applied if a.error is None}
        out.join_kinds = join_draw_kinds(run, [f for f in run.faults if (f["rank"], f["step"], f["phase"]) in done
                                               or f"{f['kind']} rank {f['rank']} at step {f['step']} {f['phase']}" in log_text])
    applied = [{r // run.shards for r in a.ranks} for a in harness.applied if a.error is None]
    out.fired = len(hit) + len(applied)
    lost = {r for lg in ledgers for line in lg for r in line["faults"]}
    # Handled: recorded as lost in a committed step, still in the last world (a flap nobody noticed),
    # or the job was relaunched from its checkpoint and finished exactly.
    handled = [{f["rank"] // run.shards} for f in hit] + applied
    out.recovered = sum(1 for replicas in handled if replicas <= lost | last or (out.relaunches and not out.violations))
    out.pauses = [p for lg in ledgers for line in lg for p in line.get("pauses_s", [])]
    return out


def _named_lost(line: str) -> set[str]:
    """The hosts a supervisor line names as lost (``lost host(s): A, B;``): a run may lose two."""
    _, found, rest = line.partition("lost host(s): ")
    return {h.strip() for h in rest.split(";", 1)[0].split(",")} if found else set()


def _unwatched_stall(run: ChaosRun, harness: Any, reasons: list[str]) -> bool:
    """The first attempt ended by the stall timeout after a replacement (a spawned process) was frozen or cut
    off with its host: Open MPI's heartbeat detector watches the ranks of the launch's own world only
    (a ring over MPI_COMM_WORLD), never a spawn's, so nobody declares such a replacement dead and the
    survivors wait in their collective until the supervisor's stall watchdog relaunches the job."""
    silent = [a for a in harness.applied if a.error is None and a.kind in ("host_freeze", "host_partition")
              and _from_replacement(run, harness, a)]
    return bool(silent) and bool(reasons) and "no progress within the stall timeout" in reasons[0]


def _from_replacement(run: ChaosRun, harness: Any, fault: Any) -> bool:
    """Whether a host fault was asked for by a replacement: a rank running away from its launch host (on the
    spare host). Its ranks are held to no marker: a replacement cut off before admission leaves by its own
    timer, and one cut off after it is never declared dead (:func:`_unwatched_stall`)."""
    return fault.error is None and 0 <= fault.rank < run.world and harness.cluster.hosts[run.host_of(fault.rank)].name != fault.host


def _let_cut_off_ranks_leave(cluster: Any, harness: Any) -> None:
    """Wait until a partitioned host's ranks left on their own (they must, for want of quorum), at most
    :data:`CUT_OFF_EXIT_BOUND_S` after the cut: the job may end before they notice, and the cleanup
    after it would otherwise kill them before they could show that they leave."""
    for a in harness.applied:
        if a.kind == "host_partition" and a.error is None:
            while cluster.ranks(a.host) and time.monotonic() < a.at + CUT_OFF_EXIT_BOUND_S:
                time.sleep(0.2)


def host_campaign(
    runs: int, seed: int, outdir: Path, steps: int, hang_timeout: float, bound_s: float, n_hosts: int, hangs: bool = True,
    two_host_faults: float = 0.0, joins: bool = False, standbys: int = 0, salvage: bool = False,
) -> list[Outcome]:
    """``--hosts N`` (with ``joins``: ``--hosts N --joins``; ``salvage``: ``--hosts N --salvage``): the campaign on N fake
    hosts built once (module docstring)."""
    from benchmarks.rigs.fake_cluster import FakeCluster
    from benchmarks.rigs.fake_netns import cleanup_stale
    from benchmarks.rigs.host_faults import HostFaultHarness

    rng = random.Random(seed)
    if salvage:
        draws = [draw_host_salvage_run(i, rng, steps, n_hosts) for i in range(runs)]
    elif joins:
        draws = [draw_host_join_run(i, rng, steps, n_hosts, standbys=standbys) for i in range(runs)]
    else:
        draws = [draw_host_run(i, rng, steps, n_hosts, hangs=hangs, two_host_faults=two_host_faults) for i in range(runs)]
    outcomes = []
    cleanup_stale()  # what a SIGKILLed earlier campaign left (only instances whose owner is gone)
    slots = max(run.slots for run, _ in draws)
    with FakeCluster(n_hosts, slots=slots) as cluster, HostFaultHarness(cluster, outdir / "host-faults") as harness:
        for run, pred in draws:
            res = execute_on_hosts(run, pred, outdir / f"run{run.index:04d}", cluster, harness, bound_s, hang_timeout)
            outcomes.append(res)
            status = "OK" if not res.violations and not res.split_brain else "VIOLATION: " + "; ".join(res.split_brain + res.violations)
            if res.relaunches:
                end = f"relaunched x{res.relaunches} ({res.relaunch_cause}; cost {'; '.join(res.relaunch_costs) or '?'})"
            else:
                end = "went on in place"
            kinds = f" {{{', '.join([*res.join_kinds, *res.salvage_events])}}}" if res.join_kinds or res.salvage_events else ""
            print(f"[{run.index + 1}/{runs}] {run.describe()} [{'; '.join(res.host_faults)}]{kinds} -> {end}, "
                  f"{res.recovered}/{res.fired} recovered in {res.seconds:.0f}s {status}", flush=True)
    return outcomes


def campaign(
    runs: int, seed: int, outdir: Path, steps: int, hang_timeout: float, bound_s: float, hangs: bool = True, stuck: bool = False,
    joins: bool = False, corrupt: bool = False, terms: bool = False, standbys: int = 0, salvage: bool = False,
) -> list[Outcome]:
    rng = random.Random(seed)
    outcomes = []
    for i in range(runs):
        run = draw_run(i, rng, steps, hangs=hangs, stuck=stuck, joins=joins, corrupt=corrupt, terms=terms, salvage=salvage)
        run.standbys = standbys if joins else 0
        res = execute(run, outdir / f"run{i:04d}", hang_timeout, bound_s)
        outcomes.append(res)
        status = "OK" if not res.violations else "VIOLATION: " + "; ".join(res.violations)
        events = f" {{{', '.join(res.salvage_events)}}}" if res.salvage_events else ""
        print(f"[{i + 1}/{runs}] {run.describe()}{events} -> {res.recovered}/{res.fired} recovered in {res.seconds:.0f}s {status}",
              flush=True)
    return outcomes




def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:
        job(argv[1], resume=RESUME_ARG in argv[2:])
        return 0
    # The driver (never a launched rank): orphans of a run re-parent to it instead of pid 1;
    # run_supervised ends each run's ranks by pid (mpiexec gives each its own process group).
    from benchmarks.proctree import become_subreaper

    become_subreaper()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    ap.add_argument("--out", default="runs/chaos", help="directory for per-run logs and ledgers")
    ap.add_argument("--hang-timeout", type=float, default=3.0, help="watchdog timeout for SIGSTOPped ranks")
    ap.add_argument("--bound", type=float, default=None,
                    help="a run longer than this counts as a hang (default 240 s; 420 s with --hosts, where a relaunch may follow a stall timeout)")
    ap.add_argument("--no-hangs", action="store_true", help="inject SIGKILLs only")
    ap.add_argument("--stuck", action="store_true", help="half of the silent faults spin in compute instead of SIGSTOP")
    ap.add_argument("--terms", action="store_true", help="half of the kills are SIGTERMs instead of SIGKILLs")
    ap.add_argument("--corrupt", action="store_true", help="one bit-flip corruption per run (silent data corruption)")
    ap.add_argument("--joins", action="store_true", help="hot re-join on, and faults on the replacements (needs --steps >= 30)")
    ap.add_argument("--salvage", action="store_true",
                    help="recover.salvage on, replicas of 2 shards: a broken replica's live ranks wait as orphans (needs --steps >= 30; "
                    "with --hosts N >= 3 and --steps >= 20, re-join on and the orphan's spawned rank on the spare host)")
    ap.add_argument("--standbys", type=int, default=0, metavar="N",
                    help="with --joins: N warm standbys (recover.rejoin.standbys); the replacements, and their faults, come from them")
    ap.add_argument("--hosts", type=int, default=0, metavar="N",
                    help="run on N >= 2 fake hosts (root) with one host fault per run, mixed with rank faults (module docstring)")
    ap.add_argument("--two-host-faults", type=float, default=0.0, metavar="P",
                    help="with --hosts N >= 3 and --steps >= 4: this fraction of the runs whose first host fault leaves the job in "
                    "place get a second one on another host in a later step (default 0)")
    args = ap.parse_args(argv)
    if args.bound is None:
        args.bound = 420.0 if args.hosts else 240.0
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    if args.standbys and not args.joins:
        ap.error("--standbys needs --joins (standbys serve re-joins)")
    if args.joins and not args.hosts and args.steps < 30:
        ap.error(f"--joins needs --steps >= 30 (a replacement takes seconds to start), got {args.steps}")
    if args.salvage and not args.hosts and args.steps < 30:
        ap.error(f"--salvage needs --steps >= 30 (a seated orphan runs the script's set-up again), got {args.steps}")
    if args.salvage and args.hosts and (args.hosts < 3 or args.steps < 20):
        ap.error(f"--hosts N --salvage needs N >= 3 (the job on two hosts, a spare host for the spawned rank) and --steps >= 20, "
                 f"got --hosts {args.hosts} --steps {args.steps}")
    if args.hosts:
        if args.hosts < 2:
            ap.error(f"--hosts must be >= 2 (a host fault needs a host besides the head, where mpiexec runs), got {args.hosts}")
        if args.steps < 3:
            ap.error(f"--hosts needs --steps >= 3 (a step before the host fault and one after), got {args.steps}")
        if args.stuck or args.corrupt or args.terms:
            ap.error("--hosts does not combine with --stuck, --corrupt or --terms (their campaigns run on one machine)")
        if args.joins and (args.hosts < 3 or args.steps < 20):
            ap.error(f"--hosts N --joins needs N >= 3 (the job on two hosts, a spare host for the replacements) and --steps >= 20 "
                     f"(a replacement takes seconds to start), got --hosts {args.hosts} --steps {args.steps}")
        if not 0 <= args.two_host_faults <= 1:
            ap.error(f"--two-host-faults must be a fraction in [0, 1], got {args.two_host_faults}")
        outcomes = host_campaign(
            args.runs, args.seed, Path(args.out), args.steps, args.hang_timeout, args.bound, args.hosts, hangs=not args.no_hangs,
            two_host_faults=args.two_host_faults, joins=args.joins, standbys=args.standbys, salvage=args.salvage,
        )
    else:
        outcomes = campaign(
            args.runs, args.seed, Path(args.out), args.steps, args.hang_timeout, args.bound, hangs=not args.no_hangs, stuck=args.stuck,
            joins=args.joins, corrupt=args.corrupt, terms=args.terms, standbys=args.standbys, salvage=args.salvage,
        )
    print(summary(outcomes))
    bad = any(o.violations or o.split_brain for o in outcomes)
    print(f"chaos: {'FAILED' if bad else 'OK'}: {len(outcomes)} runs, {sum(1 for o in outcomes if o.violations or o.split_brain)} with violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
