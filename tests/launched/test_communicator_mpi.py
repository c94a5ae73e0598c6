"""Multi-process fault tests of the ULFM communicator: real mpiexec jobs, real SIGKILLs."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from harness.mpirun import run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/comm_worker.py"


def _run(tmp_path: Path, scenario: str, victims: str = "", n: int = 4, shards: int = 1):
    job = run_mpi(n, [WORKER, scenario, victims], tmp_path / "out", timeout=90, env={"LR_SHARDS": str(shards)})
    return job, job.results()


def _check_survivors(job, results, survivors: list[int], lost_ranks: list[int]) -> None:
    assert sorted(results) == survivors, job.describe()
    for rank, res in results.items():
        assert res["exact"], f"rank {rank}: wrong sums after recovery\n{job.describe()}"
        assert res["world_epoch"] == 1, f"rank {rank}: world epoch {res['world_epoch']}, expected exactly one advance"
        assert res["members"] == survivors
        assert res["local_unchanged"], "out-of-place reduce must leave the local values (the rollback copy) intact"
        assert all(e == 1 for e in res["bucket_world_epochs"]), "every committed bucket must be from the final world epoch"
        # after_bucket saw every bucket it reported already tagged with the current world
        # epoch, and in the final world epoch it reported each bucket exactly once.
        assert all(tagged for _, tagged, _ in res["completed"]), res["completed"]
        assert sorted(i for i, _, e in res["completed"] if e == 1) == list(range(res["buckets"]))
        repairs = [e for e in res["events"] if "repair" in e]
        assert len(repairs) == 1
        assert repairs[0]["repair"]["lost_ranks"] == lost_ranks
    # Exactly one leader, the lowest surviving rank.
    assert [r for r, res in results.items() if res["leader"]] == [min(survivors)]


def test_one_kill_during_bucketed_reduce(tmp_path: Path) -> None:
    job, results = _run(tmp_path, "kill_reduce", "2")
    _check_survivors(job, results, [0, 1, 3], [2])
    for res in results.values():
        repair = next(e for e in res["events"] if "repair" in e)
        # The victim died before bucket 3: buckets 0-2 had completed under world epoch 0 and are stale.
        assert repair["stale"] == [0, 1, 2]
        assert res["buckets"] == 9


def test_two_ranks_killed_at_once(tmp_path: Path) -> None:
    job, results = _run(tmp_path, "kill_reduce", "1,2")
    _check_survivors(job, results, [0, 3], [1, 2])


def test_rank_killed_while_others_repair(tmp_path: Path) -> None:
    job, results = _run(tmp_path, "kill_in_repair", "1,3")
    _check_survivors(job, results, [0, 2], [1, 3])
    rounds = {res["events"][-2]["repair"]["rounds"] for res in results.values()}
    assert rounds == {2}, "the death during repair must have cost exactly one more repair round"


def test_rank_zero_killed(tmp_path: Path) -> None:
    job, results = _run(tmp_path, "kill_reduce", "0")
    _check_survivors(job, results, [1, 2, 3], [0])


def test_kill_between_last_bucket_and_agreement(tmp_path: Path) -> None:
    job, results = _run(tmp_path, "kill_before_agree", "2")
    _check_survivors(job, results, [0, 1, 3], [2])
    first_answers = {res["events"][0]["agreed"] for res in results.values()}
    assert first_answers == {False}, "every survivor must get the same agreement answer"
    for res in results.values():
        assert res["events"][0]["agree_in"] is True  # all buckets had completed locally...
        repair = next(e for e in res["events"] if "repair" in e)
        assert repair["stale"] == list(range(9))  # ...and all of them are rolled back


def test_replica_consistency_gate(tmp_path: Path) -> None:
    job, results = _run(tmp_path, "kill_reduce", "2", shards=2)
    # Rank 2 (replica 1, shard 0) is killed; its partner rank 3 must leave through the gate.
    assert sorted(results) == [0, 1], job.describe()
    assert "rank 3: replica-consistency gate" in job.stderr, job.describe()
    for res in results.values():
        assert res["exact"]
        assert res["alive_replicas"] == [0]
        repair = next(e for e in res["events"] if "repair" in e)["repair"]
        assert repair["lost_ranks"] == [2, 3] and repair["lost_replicas"] == [1]


def test_a_rank_whose_side_lost_quorum_leaves_while_it_waits_on_a_live_peer(tmp_path: Path) -> None:
    # 2 x 2: ranks 1 and 3 die, so no replica is whole. Ranks 0 and 2 each wait up to 120 s for a
    # message the other never sends, a wait no death fails (as a cut-off rank waits on a spawned
    # mate no detector watches): the quorum watch (comm/quorum_watch.py) ends them within
    # seconds, as a side without quorum.
    t0 = time.monotonic()
    job, results = _run(tmp_path, "lost_quorum_waiting_on_a_live_peer", "1,3", shards=2)
    took = time.monotonic() - t0
    assert results == {}, job.describe()
    for rank in (0, 2):
        # The first of them to leave may be known dead to the other too.
        found = re.search(rf"rank {rank}: no quorum: world epoch 0: rank\(s\) \[([0-9, ]+)\] known dead: no complete replica survived", job.stderr)
        assert found and {1, 3} <= {int(r) for r in found[1].split(", ")}, job.describe()
    assert took < 60, f"the job took {took:.0f} s: the survivors waited out their receive\n{job.describe()}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_sums_match_fp64_reference(tmp_path: Path, dtype: str) -> None:
    job, results = _run(tmp_path, dtype)
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    for res in results.values():
        assert res["within"], f"{dtype} sum off by {res['max_err']} from the fp64 reference"
