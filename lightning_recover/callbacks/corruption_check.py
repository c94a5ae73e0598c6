"""Silent-data-corruption check: compare the replicas' state after a commit, repair or evict the odd one.

After every N-th committed step (``recover.sdc.every_n_steps``) each rank fingerprints its
parameter shards and optimizer state (:func:`lightning_recover.corruption.fingerprint`)
and every rank gathers every rank's print (one small collective). Replicas of the same
shard index must agree bit for bit; :func:`~lightning_recover.corruption.arbitrate` names
the odd ones out by majority. Then, on every rank alike:

* ``repair`` (default): the healthy replica with the lowest index broadcasts its
  parameters and optimizer state over the shard communicators; the corrupted replica
  takes them and goes on, and a second check confirms all prints agree.
* ``evict``: the corrupted replica's ranks leave (one stderr line each); the survivors see
  an ordinary failure in the next step and recover as from any other.
* No majority (two replicas that differ, an even split): nobody can tell which copy is
  right, so every rank stops with :class:`SilentDataCorruptionError` (once the step's
  ledger line is written), whose message says to relaunch from the newest checkpoint.

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

from lightning_recover import lifecycle
from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.corruption import Fingerprint, Verdict, arbitrate, fingerprint

__all__ = ["CorruptionCheck", "SilentDataCorruptionError", "state_tensors"]


class SilentDataCorruptionError(RuntimeError):
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

    @override
    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if (step + 1) % self.every_n_steps:
            return
        strategy = trainer.strategy
        comm, engine = strategy.comm, strategy.engine
        tensors = state_tensors(strategy.model, strategy.optimizers)
        verdict, shards = self._compare(comm, engine, tensors)
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
        self._repair(comm, engine, tensors, verdict)
        if not self._compare(comm, engine, tensors)[0].clean:
            raise SilentDataCorruptionError(f"the repair after step {step} did not make the replicas agree; relaunch from the newest checkpoint")
        self.last_clean_step = step

    _stop: SilentDataCorruptionError | None = None

    @override
    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self._stop is not None:
            stop, self._stop = self._stop, None
            raise stop

    @staticmethod
    def _compare(comm: Any, engine: Any, tensors: list[torch.Tensor]) -> tuple[Verdict, list[int]]:
        """Every rank's print, gathered; the verdict and the shard indices whose replicas disagree."""
        mine: tuple[int, int, Fingerprint] = (comm.replica, comm.shard, fingerprint(tensors))
        rows = engine.run_collective(lambda: comm.allgather_object(mine))
        prints: dict[int, dict[int, Fingerprint]] = {}
        for replica, shard, fp in rows:
            prints.setdefault(int(shard), {})[int(replica)] = tuple(fp)  # type: ignore[assignment]
        return arbitrate(prints), [s for s, by in prints.items() if len(set(by.values())) > 1]

    @staticmethod
    def _repair(comm: Any, engine: Any, tensors: list[torch.Tensor], verdict: Verdict) -> None:
        # The shard communicators order replicas by index: the lowest healthy one's position is the root.
        root = sorted(comm.alive_replicas).index(verdict.healthy[0])
        engine.run_collective(lambda: comm.broadcast_tensors(tensors, root=root, across="replicas"))
