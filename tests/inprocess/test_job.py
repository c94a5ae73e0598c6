"""RecoveryJob (lightning_recover/recovery/job.py): resume, re-join hand-over and the end, without MPI.

The start itself needs MPI and runs in the launched tests (tests/test_strategy_mpi.py and the
re-join tests); here the job's communicator is the in-process fake and its engine a real StepEngine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_recover.comm.topology import RankLayout
from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.recovery.engine import StepEngine
from lightning_recover.recovery.job import RecoveryJob
from lightning_recover.testing.fake import FakeWorld
from lightning_recover.workload.factory import make_policy


def _running_job(policy: str, replicas: int) -> RecoveryJob:
    """A job as start() leaves it on a world of ``replicas`` replicas (one shard each)."""
    job = RecoveryJob(RecoverConfig(policy=policy, seed=1))
    world = FakeWorld(replicas, bucket_numel=64)
    job.comm = world.comm(0)  # type: ignore[assignment]
    job.layout = RankLayout(replicas, 1)
    job.policy = make_policy(policy, replicas, 1)
    job.engine = StepEngine(job.comm, job.policy)  # type: ignore[arg-type]
    return job


def _checkpoint_state(B: int, G: int, T: int, replicas: list[int]) -> dict[str, Any]:
    return {"B": B, "grad_accum": G, "target_replicas": T, "seed": 7, "step": 5, "replicas": replicas}


def test_a_resume_on_fewer_replicas_keeps_the_checkpoints_batch_and_seed() -> None:
    job = _running_job("static", replicas=1)
    job.load_state_dict(_checkpoint_state(B=4, G=2, T=2, replicas=[0, 1]))
    assert job.policy is not None and job.policy.B == 4, "the missing replica counts as lost: B stays T * G_init"
    assert job.engine is not None and job.engine.policy is job.policy, "the engine plans with the rebuilt policy"
    assert (job.config.seed, job.config.grad_accum, job.config.target_replicas) == (7, 2, 2)
    assert job.resumed is not None and job.resumed["step"] == 5


def test_a_resume_whose_batch_the_policy_cannot_keep_is_refused_naming_it() -> None:
    job = _running_job("adaptive", replicas=1)
    with pytest.raises(ConfigurationError, match=r"cannot keep B=4 with policy 'adaptive' on 1 replicas"):
        job.load_state_dict(_checkpoint_state(B=4, G=2, T=2, replicas=[0, 1]))


def test_state_dict_round_trips_through_a_replacements_take_over() -> None:
    donor = _running_job("static", replicas=2)
    state = donor.state_dict(step=3, planner={"next_step": 3})
    assert (state["B"], state["step"], state["replicas"], state["planner"]) == (2, 3, [0, 1], {"next_step": 3})
    state["faults_seen"] = 1
    expected = torch.rand(3)  # the RNG draw right after the donor's state was taken
    replacement = _running_job("static", replicas=2)
    replacement.take_over(state)
    assert torch.equal(torch.rand(3), expected), "the replacement continues the donor's RNG stream"
    assert replacement.engine is not None and replacement.engine.faults_seen == 1
    assert replacement.resumed is state


def test_a_job_that_never_started_ends_quietly_and_has_no_host() -> None:
    job = RecoveryJob(RecoverConfig())
    with pytest.raises(RuntimeError, match=r"no host before start\(host\)"):
        job.host
    job.close()  # nothing was started: no agreement, no watchdog to stop
    job.shutdown()
