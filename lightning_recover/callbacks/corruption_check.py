"""Silent-data-corruption check: compare the replicas' state after a commit, repair or evict the odd one.

After every N-th committed step (``recover.sdc.every_n_steps``) each rank fingerprints its
parameter shards and optimizer state (:func:`lightning_recover.audit.corruption.fingerprint`)
and compares it with the print of its shard index's first replica (a broadcast of two
words, then a world sum of one "differs" flag: constant bytes per rank whatever the job's
size). Only when some print differs does every rank gather every rank's print (O(n) per
rank, the rare path). Every one of these collectives runs through the hook's ``collectives``
argument (the engine's communicator and ``run_collective``), so a death during one is
repaired and the collective redone like any other. Replicas of the same shard index must agree bit for bit;
:func:`~lightning_recover.audit.corruption.arbitrate` names the odd ones out by majority.
Then, on every rank alike:

* ``repair`` (default): the healthy replica with the lowest index broadcasts its
  parameters and optimizer state over the shard communicators; the corrupted replica
  takes them and goes on, and a second check confirms all prints agree.
* ``evict``: the corrupted replica's ranks leave (one stderr line each); the survivors see
  an ordinary failure in the next step and recover as from any other.
* No majority (two replicas that differ, an even split): nobody can tell which copy is
  right, so every rank stops with :class:`SilentDataCorruptionError` (once the step's
  ledger line is written), whose message says to relaunch from the newest checkpoint.

**Gradient cross-check.** A spare computes the same microbatches as the contributor it
shadows, so before every reduction their accumulated gradients must agree bit for bit
(the redundant compute the protocol already pays for a free promotion). The check runs
in every checked step (every N-th) in which a spare shadows someone, in ``on_before_reduce`` (such a
step does not overlap its reduction with backward): one fingerprint of the local
gradients per rank, one gather. A pair that differs cannot say which of the two computed
wrongly, so both recompute their microbatches from a fresh accumulator
(:attr:`StepState.redo`) and compare again; a transient corruption is gone and the step
commits as if nothing happened -- it never reached the optimizer. A pair that still
differs stops the job (:class:`SilentDataCorruptionError`).

Every detection adds an event to the step's ledger line (``sdc``: the step, the replicas
and shard indices that differed, what was compared, the detection lag -- steps since the
last clean check, an upper bound on how long the corruption went unseen -- and the
response). Caught here, after the commit, a corruption of the parameters or optimizer
state never reaches another replica's gradients when N = 1; with a larger N a corrupted
replica contributes wrong gradients for up to N - 1 steps, which the sum spreads to every
replica identically (then no check can see it any more: choose N accordingly).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from typing_extensions import override

from lightning_recover.audit.corruption import Fingerprint, Verdict, arbitrate, fingerprint
from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.errors import RecoverError
from lightning_recover.recovery.hooks import StepCollectives
from lightning_recover.recovery.state import StepState
from lightning_recover.runtime import lifecycle

__all__ = ["CorruptionCheck", "SilentDataCorruptionError", "state_tensors"]


class SilentDataCorruptionError(RecoverError, RuntimeError):
    """Replicas hold different state and no majority says which copy is right."""


def state_tensors(model: torch.nn.Module, optimizers: list[Any]) -> list[torch.Tensor]:
    """This rank's parameter shards, then each optimizer's per-parameter state tensors, in a fixed order."""
    params = [p for p in model.parameters()]
    out = [_local(p.data) for p in params]
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # LightningOptimizer wraps the torch optimizer (no public accessor)
        for p in params:
            state = opt.state.get(p, {})
            out += [_local(v) for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class CorruptionCheck(RecoveryCallback):
    """Fingerprint comparison every ``every_n_steps`` committed steps; see the module docstring."""

    def __init__(self, every_n_steps: int, action: str = "repair") -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}; leave the callback out to turn checks off")
        if action not in ("repair", "evict"):
            raise ValueError(f"action must be 'repair' or 'evict', got {action!r}")
        self.every_n_steps = every_n_steps
        self.action = action
        #: The last step whose check found every replica in agreement (-1: none yet).
        self.last_clean_step = -1
        #: Checks run and corruptions found on this rank, for a run's summary.
        self.checks = 0
        self.detections = 0
        # Gradient cross-check: recomputations asked for in the current step, events to record at its commit.
        self._redone_in_step: tuple[int, int] | None = None
        self._pending: list[dict[str, Any]] = []
        #: No majority: raised in on_train_batch_end, once the step's ledger line is written.
        self._stop: SilentDataCorruptionError | None = None

    def _shadowing(self, step: StepState) -> dict[int, int]:
        """Spare -> the contributor it shadows, in the steps whose gradients are cross-checked."""
        if (step.step + 1) % self.every_n_steps:
            return {}  # the cross-check runs in the steps whose commit is checked
        return step.plan.shadowing()

    @override
    def on_before_overlap(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        if self._shadowing(step):
            step.reduction.overlap = False  # the cross-check compares whole accumulated gradients, before any is sent

    @override
    def on_before_reduce(self, trainer: Any, pl_module: Any, step: StepState, collectives: StepCollectives) -> None:
        shadowing = self._shadowing(step)
        if not shadowing:
            return
        strategy = trainer.strategy
        comm: Any = collectives.comm  # the job's FaultTolerantComm (allgather_object is beyond the engine's contract)
        # What each accumulator holds, with the print: after a failure a boundary step adds other
        # ids to some accumulators, and only two that hold the same ids must agree.
        mine = (comm.replica, comm.shard, tuple(sorted(step.work.computed)), fingerprint(step.reduction.local))
        rows = collectives.run(lambda: comm.allgather_object(mine))
        if step.replan_pending:
            step.requests.redo = ()  # a replica died in the gather: the engine re-plans, then this check runs again
            return
        prints = {(int(r), int(s)): (tuple(ids), tuple(fp)) for r, s, ids, fp in rows}
        differing = [
            (spare, shadowed, s) for spare, shadowed in shadowing.items() for s in range(strategy.config.shards)
            if (spare, s) in prints and (shadowed, s) in prints
            and prints[spare, s][0] == prints[shadowed, s][0] and prints[spare, s][1] != prints[shadowed, s][1]
        ]
        suspects = sorted({r for spare, shadowed, _ in differing for r in (spare, shadowed)})
        self.checks += 1
        if not suspects:
            return
        self.detections += 1
        if self._redone_in_step == (step.step, step.world_epoch):
            raise SilentDataCorruptionError(
                f"step {step.step}: replicas {suspects} computed different gradients for the same microbatches twice in a "
                "row (a persistent fault, not a transient one); relaunch from the newest checkpoint without that hardware"
            )
        self._redone_in_step = (step.step, step.world_epoch)
        self._pending.append({
            "step": step.step, "replicas": suspects, "shards": sorted({s for _, _, s in differing}), "what": "gradients (spare cross-check)",
            "lag_steps": 0, "action": "recompute",
        })
        if comm.is_leader:
            print(
                f"[lightning-recover] silent data corruption in step {step.step}: a spare and the contributor it shadows "
                f"(replicas {suspects}) computed different gradients; both recompute the step before it is reduced",
                file=sys.stderr, flush=True,
            )
        step.requests.redo = tuple(step.mine.ids) if comm.replica in suspects else ()

    @override
    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any], collectives: StepCollectives) -> None:
        step = int(record["step"])
        if self._pending:
            record.setdefault("sdc", []).extend(self._pending)
            self._pending = []
        if (step + 1) % self.every_n_steps:
            return
        strategy = trainer.strategy
        comm: Any = collectives.comm  # the job's FaultTolerantComm
        tensors = state_tensors(strategy.model, strategy.optimizers)
        verdict, shards = self._compare(collectives, tensors)
        self.checks += 1
        if verdict.clean:
            self.last_clean_step = step
            return
        self.detections += 1
        differing = sorted(shards)
        event = {
            "step": step, "replicas": list(verdict.odd), "shards": differing, "what": "parameters+optimizer state",
            "lag_steps": step - self.last_clean_step, "action": "stop" if verdict.undecidable else self.action,
        }
        record.setdefault("sdc", []).append(event)
        who = f"replica(s) {list(verdict.odd)}" if verdict.odd else "the replicas (no majority)"
        if comm.is_leader:
            print(
                f"[lightning-recover] silent data corruption after step {step}: {who} differ in shard(s) {differing} "
                f"(at most {event['lag_steps']} step(s) since the last clean check); action: {event['action']}",
                file=sys.stderr, flush=True,
            )
        if verdict.undecidable:
            # Raised once the step's ledger line (with this event) is written: on_train_batch_end.
            self._stop = SilentDataCorruptionError(
                f"after step {step} the replicas {sorted(set(comm.alive_replicas))} hold different parameters or optimizer "
                f"state in shard(s) {list(verdict.undecidable)}, and without a majority no replica can be trusted over "
                "another; relaunch from the newest checkpoint (ckpt_path=last), or run 3 or more replicas so that a "
                "majority can name the corrupted one"
            )
            return
        if self.action == "evict":
            if comm.replica in verdict.odd:
                lifecycle.gate_exit(
                    comm.rank, f"silent data corruption after step {step}: this replica's state is the odd one out; "
                    "evicted (recover.sdc.action=evict)"
                )
            return
        self._repair(collectives, tensors, verdict)
        if not self._compare(collectives, tensors)[0].clean:
            raise SilentDataCorruptionError(f"the repair after step {step} did not make the replicas agree; relaunch from the newest checkpoint")
        self.last_clean_step = step

    @override
    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self._stop is not None:
            stop, self._stop = self._stop, None
            raise stop

    @staticmethod
    def _compare(collectives: StepCollectives, tensors: list[torch.Tensor]) -> tuple[Verdict, list[int]]:
        """The verdict and the shard indices whose replicas disagree: every print equal to its
        shard index's first replica's is clean at once; otherwise every rank's print is gathered."""
        comm: Any = collectives.comm
        fp = fingerprint(tensors)
        if collectives.run(lambda: CorruptionCheck._all_equal(comm, fp)):
            return Verdict(), []
        mine: tuple[int, int, Fingerprint] = (comm.replica, comm.shard, fp)
        rows = collectives.run(lambda: comm.allgather_object(mine))
        prints: dict[int, dict[int, Fingerprint]] = {}
        for replica, shard, fp in rows:
            prints.setdefault(int(shard), {})[int(replica)] = tuple(fp)  # type: ignore[assignment]
        return arbitrate(prints), [s for s, by in prints.items() if len(set(by.values())) > 1]

    @staticmethod
    def _all_equal(comm: Any, fp: Fingerprint) -> bool:
        """Whether every rank's print equals its shard index's first replica's (the same answer on every rank).

        Constant bytes per rank: the gather of every print grew with the job (O(n) per rank, 100k
        rows at 10^5 ranks) although a clean check needs only "does anyone differ"."""
        words = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in fp], dtype=torch.int64)  # prints are unsigned 64-bit
        first = words.clone()
        comm.broadcast_tensors([first], root=0, across="replicas")
        differs = torch.tensor([0.0 if torch.equal(first, words) else 1.0], dtype=torch.float64)
        total = torch.empty_like(differs)
        comm.allreduce([differs], [total], across="world")
        return float(total[0]) == 0.0

    @staticmethod
    def _repair(collectives: StepCollectives, tensors: list[torch.Tensor], verdict: Verdict) -> None:
        comm: Any = collectives.comm
        # The shard communicators order replicas by index: the lowest healthy one's position is the root.
        root = sorted(comm.alive_replicas).index(verdict.healthy[0])
        collectives.run(lambda: comm.broadcast_tensors(tensors, root=root, across="replicas"))
