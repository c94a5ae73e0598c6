"""AdaptiveWorld: the torchft-like ablation of the workload policy (layer 3).

Each replica owns fixed microbatch ids (G_init of them); lost ids are dropped and the step
divides by what survived, so B shrinks with every failure -- the behaviour StaticWorld
(:mod:`lightning_recover.workload.static_world`) is measured against. No spares, no replay.
A joiner computes its own ids at once, the batch grows back. The protocol is
:class:`lightning_recover.workload.policy.WorkloadPolicy`'s.
"""

from __future__ import annotations

from collections.abc import Collection

from lightning_recover.workload.policy import WorkloadPolicy, _check_setting, _Slot
from lightning_recover.workload.step_plan import CommitRecord, Role, StepPlan

__all__ = ["AdaptiveWorld"]


class AdaptiveWorld(WorkloadPolicy):
    """Ablation (torchft-like): fixed ownership, no spares, no replay, divide by survivors."""

    name = "adaptive"

    def __init__(self, W_init: int, G_init: int, min_replicas: int = 1) -> None:
        W_init = _check_setting("W_init", W_init, 1, "start at least one replica")
        G_init = _check_setting("G_init", G_init, 1, "set recover.grad_accum to a positive integer")
        min_replicas = self._check_min_replicas(min_replicas, W_init)
        super().__init__(W_init, G_init, W_init, min_replicas)
        self.G_cur = G_init

    def _own(self, r: int) -> _Slot:
        G = self.G_init
        return _Slot(Role.MAJOR, tuple(range(r * G, (r + 1) * G)), True, None)

    def begin_step(self, step: int, alive: Collection[int]) -> StepPlan:
        live = self._open(step, alive)
        self._slots = {r: self._own(r) for r in live}
        return self._plan()

    def fail(self, lost: Collection[int]) -> StepPlan:
        self._lose(lost)  # their ids are simply dropped
        return self._plan()

    def _plan(self) -> StepPlan:
        assert self._step is not None
        return StepPlan(
            step=self._step,
            B=self.B,
            plans=self._frozen_plans(),
            divisor=len(self._slots) * self.G_init,
            G_cur=self.G_init,
            G_ext=0,
        )

    def commit(self) -> CommitRecord:
        step = self._require_open("commit")
        plan = self._plan()
        ids = plan.committed_ids
        record = CommitRecord(
            step=step,
            B=self.B,
            committed=len(ids),
            microbatch_ids=tuple(step * self.B + i for i in ids),
            replicas=plan.live,
            roles={r: p.role.value for r, p in plan.plans.items()},
            faults=tuple(self._faults),
            extra_microbatches=0,
            G_cur=self.G_init,
            joined=tuple(sorted(self._joined)),
        )
        self._next_step = step + 1
        self._step = None
        self._slots = {}
        self._faults = []
        self._joined = set()
        return record
