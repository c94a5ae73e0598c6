"""AdaptiveWorld: the torchft-like ablation of the workload policy (ReCoVer's versatile workload).

Each replica owns fixed microbatch ids (G_init of them); lost ids are dropped and the step
divides by what survived, so B shrinks with every failure -- the behaviour StaticWorld
(:mod:`lightning_recover.workload.static_world`) is measured against. No spares, no replay.
A joiner computes its own ids at once, the batch grows back. The protocol is
:class:`lightning_recover.workload.policy.WorkloadPolicy`'s.
"""

from __future__ import annotations

from collections.abc import Collection

from lightning_recover.workload.policy import WorkloadPolicy, _check_setting
from lightning_recover.workload.step_plan import CommitRecord, Membership, StepPlan, ranges_of

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

    def _steady_membership(self, live: tuple[int, ...], joined: Collection[int]) -> Membership:
        # Fixed ownership: replica r holds [r*G, (r+1)*G) whatever else is live.
        return Membership(B=self.B, G=self.G_init, veterans=live, n_major=len(live), fixed=True)

    def begin_step(self, step: int, alive: Collection[int]) -> StepPlan:
        self._open(step, alive)
        return self._plan()

    def fail(self, lost: Collection[int]) -> StepPlan:
        self._lose(lost)  # their ids are simply dropped
        return self._plan()

    def _plan(self) -> StepPlan:
        return self._step_plan(divisor=len(self._live) * self.G_init, G_cur=self.G_init)

    def commit(self) -> CommitRecord:
        self._require_open("commit")
        G = self.G_init
        # The live replicas' own blocks, as runs of consecutive replicas (O(runs), not O(W)).
        ids = tuple((lo * G, hi * G) for lo, hi in ranges_of(self._live))
        return self._record(ids, len(self._live) * G, 0, G)
