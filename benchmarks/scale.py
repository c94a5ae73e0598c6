"""The protocol's own bookkeeping at 64 to 131,072 replicas: what one rank pays per step, per failure, per join.

Role: issue 33's proof that a steady step costs O(1) per rank and a failure O(changed)
(at worst O(W) once, at C speed). It runs the package's real code in one process, one rank's
view of a W-replica job (``python -m benchmarks.scale``; ``--quick`` for a smoke test):

* **policy**: ``StaticWorld`` (T = W - W/16, G_init = 8, so B = 983,040 at 131k replicas)
  ``begin_step`` + ``commit`` + the ledger dict, per steady step;
* **rank step**: a whole steady step of one rank's bookkeeping: the
  :class:`~lightning_recover.recovery.engine.StepEngine` (begin, the planned microbatches,
  the reduction with its header, agreement and commit, the recovery callbacks that run in
  production), the feed's forecast (``steady_ids``) and the leader's ledger write. The communicator is
  :class:`OneRankComm`: one rank's view of a W-replica world whose collectives return at
  once (their MPI cost per rank is ``benchmarks/control_plane.py``'s), so what is timed is
  exactly the bookkeeping that could grow with W;
* **failure**: ``begin_step`` + ``fail`` of one replica + ``commit`` (a contributor whose
  ids are replayed, and one a spare absorbs), the engine's whole recovery path with the
  repair scripted, the quorum's verdict, and the next step's re-plan (a membership change);
* **planner**: the sample indices of the rank's microbatches per step, over a dataset of
  ``--dataset`` samples (its per-epoch permutation amortised over the epoch's steps);
* **join of 64**: ``join`` of 64 replicas at a boundary + the joiners' first step + the next;
* **ledger**: bytes of a steady line and of a membership-change line as the engine writes
  them, and ``check-ledger`` + ``report`` on 10^5 steps at W = 32,768, B = 262,144.

Times are the main thread's CPU seconds (``time.thread_time``: a busy machine does not
inflate them; the ledger's fsync thread is off the step's critical path and not counted),
the median of ``--reps`` repetitions. Each quantity gets its fitted growth ``t ~ W^k``
(least squares on log-log). Results go to ``benchmarks/results/scale.json``; its ``curves``
(:func:`fitted_costs`: cost = a * W^k per quantity) are what ``benchmarks/simulate.py`` reads. The last line is the headline:
steady rank step at 32,768 replicas over its cost at 64.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

from lightning_recover.audit.ledger_check import check_ledger  # noqa: E402
from lightning_recover.audit.ledger_writer import LedgerWriter  # noqa: E402
from lightning_recover.audit.report import report_from_path  # noqa: E402
from lightning_recover.callbacks.boundary import BoundaryScheduler  # noqa: E402
from lightning_recover.callbacks.epoch_check import EpochCheck  # noqa: E402
from lightning_recover.callbacks.reduction_buffers import ReductionBuffers  # noqa: E402
from lightning_recover.comm import quorum  # noqa: E402
from lightning_recover.comm.buckets import ReduceHandle, plan_buckets  # noqa: E402
from lightning_recover.comm.interface import PeerFailure, RepairResult  # noqa: E402
from lightning_recover.recovery.engine import StepEngine  # noqa: E402
from lightning_recover.recovery.hooks import HookCalls  # noqa: E402
from lightning_recover.workload.factory import make_policy  # noqa: E402
from lightning_recover.workload.planner import MicrobatchPlanner  # noqa: E402
from lightning_recover.workload.policy import WorkloadPolicy  # noqa: E402
from benchmarks.scaling import fit_power

RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
SIZES = (64, 1024, 8192, 32768, 131072)
G_INIT = 8


def targets(W: int) -> int:
    """T for W replicas: one in sixteen is a spare (the paper's setting keeps a few)."""
    return max(1, W - W // 16)


class OneRankComm:
    """One rank's view of a W-replica world: collectives return at once, a repair is scripted.

    ``fail_next``: the next reduction raises PeerFailure and the repair then removes these
    replicas, as FaultTolerantComm would report them."""

    def __init__(self, W: int, replica: int = 0) -> None:
        self.rank, self.replica, self.shard, self.world_epoch = replica, replica, 0, 0
        self.alive_replicas: tuple[int, ...] = tuple(range(W))
        self.fail_next: tuple[int, ...] = ()

    @property
    def members(self) -> tuple[int, ...]:
        return (self.rank,)  # the header counts this rank once: the sum of one

    def plan(self, tensors: Sequence[torch.Tensor]) -> ReduceHandle:
        return ReduceHandle(plan_buckets([t.numel() for t in tensors], 1 << 20))

    def allreduce(self, tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None, *, handle: ReduceHandle | None = None,
                  across: str = "replicas", on_bucket: Callable[[int], None] | None = None,
                  after_bucket: Callable[[int], None] | None = None) -> ReduceHandle:
        if self.fail_next:
            raise PeerFailure((), "a scripted loss")
        handle = handle or self.plan(tensors)
        for i in handle.pending(self.world_epoch):
            if on_bucket is not None:
                on_bucket(i)
            for (ti, s, e) in handle.buckets[i].segments:
                (out or tensors)[ti].view(-1)[s:e].copy_(tensors[ti].view(-1)[s:e])
            handle.buckets[i].world_epoch = self.world_epoch
            if after_bucket is not None:
                after_bucket(i)
        return handle

    def agree(self, flag: bool = True) -> bool:
        return flag and not self.fail_next

    def repair(self) -> RepairResult:
        lost, self.fail_next = self.fail_next, ()
        previous = self.alive_replicas
        self.alive_replicas = tuple(r for r in previous if r not in set(lost))
        self.world_epoch += 1
        return RepairResult(self.world_epoch, lost, lost, self.alive_replicas, 0.0, 1)


class Runner:
    """Computes nothing: the engine's bookkeeping is what is timed, not a model."""

    def __init__(self, engine: StepEngine) -> None:
        self.engine, self.grads = engine, [torch.zeros(16)]

    def run_microbatch(self, offset: int) -> None:
        self.engine.record(offset, 1.0)

    def local_grads(self) -> list[torch.Tensor]:
        return self.grads


class Rank:
    """One rank's bookkeeping for a job of W replicas, as the strategy drives it each step."""

    def __init__(self, W: int, ledger: Path, replica: int = 0) -> None:
        self.comm = OneRankComm(W, replica)
        self.policy: WorkloadPolicy = make_policy("static", W, G_INIT, T=targets(W))
        callbacks = [ReductionBuffers(), EpochCheck(), BoundaryScheduler()]
        self.engine = StepEngine(self.comm, self.policy, hooks=HookCalls(lambda: callbacks))  # type: ignore[arg-type]
        self.runner = Runner(self.engine)
        self.ledger = LedgerWriter(ledger)
        self.step = 0
        self.last: dict[str, Any] = {}

    def run_step(self) -> dict[str, Any]:
        self.engine.begin(self.step)
        first = self.engine.start_planned()
        self.runner.run_microbatch(first)
        self.engine.run_planned(self.runner)
        self.engine.reduce_until_committed(self.runner)
        record = self.engine.finish()
        self.policy.steady_ids(self.comm.alive_replicas, self.comm.replica)  # the feed's forecast of the next step
        self.ledger.write(record)
        self.step += 1
        self.last = record
        return record


def cpu(fn: Callable[[], Any], n: int = 1) -> float:
    """Main-thread CPU seconds per call of ``fn``, over ``n`` calls."""
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) / n


def median_of(reps: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(reps))


def measure(W: int, reps: int, steps: int, tmp: Path, dataset: int) -> dict[str, Any]:
    out: dict[str, Any] = {"W": W, "T": targets(W), "B": targets(W) * G_INIT}
    policy = make_policy("static", W, G_INIT, T=targets(W))
    alive = tuple(range(W))
    step = iter(range(10**9))

    def policy_step() -> None:
        policy.begin_step(next(step), alive)
        policy.commit().as_dict()

    policy_step()  # the first step plans the membership
    out["policy_step_s"] = median_of(reps, lambda: cpu(policy_step, steps))

    rank = Rank(W, tmp / f"ledger-{W}.jsonl")
    rank.run_step()
    first_line = len(json.dumps(rank.last))
    out["rank_step_s"] = median_of(reps, lambda: cpu(rank.run_step, steps))
    out["steady_line_bytes"] = len(json.dumps(rank.last))

    def lossy_policy_step(victim: int) -> Callable[[], None]:
        def run() -> None:
            p = make_policy("static", W, G_INIT, T=targets(W))
            p.begin_step(0, alive)
            p.commit()
            t0 = time.thread_time()
            p.begin_step(1, alive)
            p.fail([victim])
            p.commit()
            costs.append(time.thread_time() - t0)
            t0 = time.thread_time()
            p.begin_step(2, tuple(r for r in alive if r != victim))
            p.commit()
            replans.append(time.thread_time() - t0)
        return run

    for kind, victim in (("replayed", W // 3), ("absorbed", 0)):
        costs: list[float] = []
        replans: list[float] = []
        for _ in range(reps):
            lossy_policy_step(victim)()
        out[f"fail_{kind}_s"] = statistics.median(costs)
        out[f"replan_{kind}_s"] = statistics.median(replans)

    def engine_loss() -> float:
        r = Rank(W, tmp / f"ledger-{W}-loss.jsonl")
        r.run_step()
        r.comm.fail_next = (W // 3,)
        t0 = time.thread_time()
        r.run_step()
        lossy = time.thread_time() - t0
        change_line.append(len(json.dumps(r.last)))
        t0 = time.thread_time()
        r.run_step()  # the new live set's first step
        replan.append(time.thread_time() - t0)
        r.ledger.close()
        return lossy

    change_line: list[int] = []
    replan: list[float] = []
    out["engine_loss_s"] = median_of(reps, engine_loss)
    out["engine_replan_s"] = statistics.median(replan)
    out["change_line_bytes"] = max(change_line[0], first_line)
    out["quorum_s"] = median_of(reps, lambda: cpu(lambda: quorum.decide(alive, alive[: W - 1], (W - 1,), 0)))

    def join64() -> float:
        p = make_policy("static", W, G_INIT, T=targets(W))
        lost = tuple(range(W - 64, W)) if W > 64 else tuple(range(W // 2, W))
        p.begin_step(0, alive)
        p.fail(lost)
        p.commit()
        left = tuple(r for r in alive if r not in set(lost))
        p.begin_step(1, left)
        p.commit()
        t0 = time.thread_time()
        p.join(lost)
        p.begin_step(2, alive)
        p.commit()
        p.begin_step(3, alive)  # the joiners' second step: they are veterans now
        p.commit()
        return time.thread_time() - t0

    out["join64_s"] = median_of(reps, join64)

    planner = MicrobatchPlanner(dataset_len=dataset, B=out["B"], microbatch_size=1)
    epoch_steps = max(1, dataset // out["B"])
    ids = policy.steady_ids(alive, 0)
    epochs = iter(range(1, 10**9))

    def new_epoch() -> None:  # the first sample of an epoch draws the epoch's permutation
        planner.sample_indices(next(epochs) * epoch_steps * out["B"], 0)

    def lookups() -> None:
        for offset in ids:
            planner.sample_indices(planner.global_id(0, offset), 0)

    # A step's share of its epoch's permutation, plus its own microbatches' lookups.
    out["planner_step_s"] = median_of(reps, lambda: cpu(new_epoch) / epoch_steps + cpu(lookups, steps))
    return out


def write_ledger(path: Path, W: int, G: int, steps: int, loss_at: int) -> float:
    """``steps`` steps of the real policy at W replicas (no spares: B = W * G), one loss; returns seconds."""
    policy = make_policy("static", W, G)
    alive = tuple(range(W))
    t0 = time.perf_counter()
    with open(path, "w") as fh:
        for s in range(steps):
            policy.begin_step(s, alive)
            if s == loss_at:
                policy.fail([W // 2])
            commit = policy.commit()
            rec = commit.as_dict()
            rec.update(loss=2.0 - s * 1e-6, world_epoch=int(s >= loss_at), step_time_s=5.0, recovery_s=0.0, pauses_s=[], detect_s=0.0,
                       detects_s=[], stale_buckets=0, overlapped=True, policy="static", divisor=commit.B, joins=[])
            fh.write(json.dumps(rec) + "\n")
            alive = commit.replicas
    return time.perf_counter() - t0


#: The quantities simulate.py takes per job size, fitted as cost = a * W^k seconds.
CURVES = ("rank_step_s", "engine_loss_s", "engine_replan_s", "join64_s")


def fitted_costs(rows: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """``{quantity: (a, k)}`` with cost = a * W^k seconds, fitted on the rows' medians."""
    return {key: fit_power([r["W"] for r in rows], [r[key] for r in rows]) for key in CURVES}


COLUMNS = (
    ("policy_step_s", "policy step", 1e3, "ms"),
    ("rank_step_s", "rank step", 1e3, "ms"),
    ("fail_replayed_s", "loss (replay)", 1e3, "ms"),
    ("fail_absorbed_s", "loss (spare)", 1e3, "ms"),
    ("engine_loss_s", "engine loss", 1e3, "ms"),
    ("engine_replan_s", "re-plan", 1e3, "ms"),
    ("quorum_s", "quorum", 1e3, "ms"),
    ("join64_s", "join 64", 1e3, "ms"),
    ("planner_step_s", "planner", 1e3, "ms"),
    ("steady_line_bytes", "line B", 1, ""),
    ("change_line_bytes", "change B", 1, ""),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="replica counts W")
    p.add_argument("--reps", type=int, default=5, help="repetitions per quantity (the median is kept)")
    p.add_argument("--steps", type=int, default=200, help="steady steps per repetition")
    p.add_argument("--ledger-steps", type=int, default=100_000, help="steps of the check-ledger run (W=32,768, B=262,144)")
    p.add_argument("--dataset", type=int, default=10**9, help="samples in the planner's dataset (one sample a microbatch)")
    p.add_argument("--quick", action="store_true", help="small sizes and few steps (a smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.reps, args.steps, args.ledger_steps, args.dataset = [64, 512, 2048], 1, 10, 1000, 1 << 16
    torch.set_num_threads(1)
    logging.getLogger("lightning_recover").setLevel(logging.ERROR)  # the scripted losses' warnings
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print("  ".join(f"{h:>13}" for h in ["W", *[c[1] for c in COLUMNS]]))
        for W in args.sizes:
            row = measure(W, args.reps, args.steps, Path(tmp), args.dataset)
            rows.append(row)
            print("  ".join([f"{W:>13}", *(f"{row[k] * s:>11.3f}{u:>2}" if u else f"{row[k]:>13}" for k, _, s, u in COLUMNS)]), flush=True)
        fits = {k: fit_power([r["W"] for r in rows], [r[k] for r in rows])[1] for k, *_ in COLUMNS}
        print("  ".join([f"{'growth W^k':>13}", *(f"{fits[k]:>13.2f}" for k, *_ in COLUMNS)]))
        W_l, G_l = (32768, 8) if not args.quick else (2048, 8)
        ledger = Path(tmp) / "big.jsonl"
        made = write_ledger(ledger, W_l, G_l, args.ledger_steps, loss_at=args.ledger_steps // 2)
        size = ledger.stat().st_size
        t0 = time.perf_counter()
        verdict = check_ledger(ledger)
        check_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = report_from_path(ledger)
        report_s = time.perf_counter() - t0
        if not verdict.ok or report.faults != 1:
            print(f"scale.py: the generated ledger did not check: {verdict.summary_line()}", file=sys.stderr)
            return 1
        per = 100_000 / args.ledger_steps
        print(f"ledger at W={W_l}, B={W_l * G_l}: {args.ledger_steps} steps, {size / args.ledger_steps:.0f} B/line "
              f"(written in {made:.1f} s); check-ledger {check_s:.2f} s ({check_s * per:.1f} s per 10^5 steps), "
              f"report {report_s:.2f} s; {verdict.summary_line()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    provenance = {"command": "python -m benchmarks.scale " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                  f"Python {platform.python_version()}", "cpu_time": "main-thread CPU seconds (time.thread_time), median of --reps"}
    args.out.write_text(json.dumps({"provenance": provenance, "rows": rows, "fits": fits, "curves": fitted_costs(rows), "ledger": {
        "W": W_l, "B": W_l * G_l, "steps": args.ledger_steps, "bytes_per_line": size / args.ledger_steps,
        "check_s_per_1e5": check_s * per, "report_s_per_1e5": report_s * per}}, indent=1))
    by_W = {r["W"]: r for r in rows}
    lo, hi = min(by_W), (32768 if 32768 in by_W else max(by_W))
    rank_ratio = by_W[hi]["rank_step_s"] / by_W[lo]["rank_step_s"]
    ratio = by_W[hi]["policy_step_s"] / by_W[lo]["policy_step_s"]
    print(f"steady step (plan + commit + ledger record) at W={hi}: {by_W[hi]['policy_step_s'] * 1e3:.4f} ms, at W={lo}: "
          f"{by_W[lo]['policy_step_s'] * 1e3:.4f} ms (whole rank bookkeeping {rank_ratio:.2f}x); ratio {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
