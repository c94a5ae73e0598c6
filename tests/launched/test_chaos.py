"""The chaos campaign (benchmarks/chaos.py): its draws and predictions (benchmarks.rigs.campaign)
are sane, and a short campaign of real runs has no violation."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.rigs.campaign import (
    HOST_FAULT_KINDS, JOIN_DRAW_KINDS, JOIN_PHASES, PHASES, SALVAGE_HOST_KINDS, SALVAGE_TOPOLOGIES, SECOND_HOST_FAULT_KINDS,
    SPARE_HOST, ChaosRun, Prediction, draw_host_join_run, draw_host_run, draw_host_salvage_run, draw_run, join_draw_kinds,
    last_relaunch_idle, predict,
)
from lightning_recover.callbacks.fault_injection import FaultSpec

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 6))
def test_draws_lose_at_most_w_minus_one_whole_replicas(seed: int, steps: int) -> None:
    run = draw_run(0, random.Random(seed), steps)
    replicas = [f["rank"] // run.shards for f in run.faults]
    assert 1 <= len(replicas) <= run.replicas - 1
    assert len(set(replicas)) == len(replicas), "one fault per victim replica"
    for f in run.faults:
        assert 0 <= f["rank"] < run.world and 0 <= f["step"] < steps
        assert f["phase"] in PHASES and f["kind"] in ("kill", "hang")


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_join_draws_add_faults_only_on_the_victims_replacements(seed: int) -> None:
    plain, joins = draw_run(0, random.Random(seed), 40), draw_run(0, random.Random(seed), 40, joins=True)
    assert joins.rejoin and not plain.rejoin
    n = len(plain.faults)
    assert joins.faults[:n] == plain.faults, "the rest of a seed's draw is unchanged"
    victims = {f["rank"] // plain.shards for f in plain.faults}
    for f in joins.faults[n:]:
        assert f["phase"] in JOIN_PHASES and f["kind"] == "kill" and f["step"] in (1, 2)
        assert f["rank"] // joins.shards in victims, "only a lost replica has a replacement to kill"


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 6))
def test_stuck_faults_replace_only_some_hangs(seed: int, steps: int) -> None:
    plain, mixed = draw_run(0, random.Random(seed), steps), draw_run(0, random.Random(seed), steps, stuck=True)
    assert len(plain.faults) == len(mixed.faults)
    for a, b in zip(plain.faults, mixed.faults):
        assert {**a, "kind": None} == {**b, "kind": None}  # same victim, step, phase, timing
        assert b["kind"] == a["kind"] or (a["kind"], b["kind"]) == ("hang", "stuck")


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 6))
def test_terms_replace_only_some_kills(seed: int, steps: int) -> None:
    plain, mixed = draw_run(0, random.Random(seed), steps, stuck=True), draw_run(0, random.Random(seed), steps, stuck=True, terms=True)
    assert len(plain.faults) == len(mixed.faults)
    for a, b in zip(plain.faults, mixed.faults):
        assert {**a, "kind": None} == {**b, "kind": None}  # same victim, step, phase, timing
        assert b["kind"] == a["kind"] or (a["kind"], b["kind"]) == ("kill", "term")


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), joins=st.booleans())
def test_salvage_draws_break_replicas_of_two_shards(seed: int, joins: bool) -> None:
    run = draw_run(0, random.Random(seed), 40, joins=joins, salvage=True)
    assert run.salvage and run.rejoin is joins and (run.replicas, run.shards, run.target) in SALVAGE_TOPOLOGIES
    assert all(s == 2 for _, s, _ in SALVAGE_TOPOLOGIES), "a replica of one shard leaves no orphan"
    training = [f for f in run.faults if f["phase"] not in JOIN_PHASES]
    victims = [f["rank"] // run.shards for f in training]
    assert 1 <= len(victims) <= run.replicas - 1 and len(set(victims)) == len(victims)
    assert "salvage" in run.describe()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(20, 40))
def test_host_salvage_draws_break_host_1s_replica_and_spare_the_head(seed: int, steps: int) -> None:
    run, pred = draw_host_salvage_run(0, random.Random(seed), steps, 3)
    assert run.salvage and run.rejoin and (run.hosts, run.slots, run.replicas, run.shards) == (3, 2, 2, 2)
    first, *later = run.faults
    assert first["kind"] == "kill" and run.host_of(first["rank"]) == 1 and 1 <= first["step"] <= 3
    for f in later:  # on the re-formed replica: its spawned rank (the lost rank's) or its seated orphan
        assert f["kind"] in SALVAGE_HOST_KINDS and f["rank"] in (2, 3) and steps - 8 <= f["step"] <= steps - 3
    assert pred.proceeds and pred.rejoin and pred.final == (frozenset({0}),), "the head's replica is never hit"
    with pytest.raises(ValueError, match="N >= 3"):
        draw_host_salvage_run(0, random.Random(seed), steps, 2)


@pytest.mark.mpi
def test_short_campaign_has_no_violation(tmp_path: Path) -> None:
    # With --stuck and --terms, seed 638 draws 3 runs over 3 topologies: a 2x2 with a SIGSTOP in a
    # reduction; a 5x1 with a spare (T=4) where a SIGTERM, a SIGKILL, a SIGSTOP and a rank spinning
    # in compute meet in one step; a 4x1 with a spare (T=3) losing two ranks in step 0 and one by
    # SIGTERM in step 1.
    cmd = [
        sys.executable, "-m", "benchmarks.chaos", "--runs", "3", "--seed", "638", "--steps", "2", "--stuck",
        "--terms", "--out", str(tmp_path),
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    assert lines[-1].startswith("chaos: OK: 3 runs, 0 with violations")
    assert sum(" stuck -> " in line or " stuck, " in line for line in lines) == 1, "the draw should hold one stuck fault"
    assert any(" term" in line and " kill" in line for line in lines if line.startswith("[")), "a run should mix SIGTERM and SIGKILL"
    table = dict(line.split("  ", 1) for line in lines if not line.startswith(("[", "chaos:")))
    table = {k.strip(): v.strip() for k, v in table.items()}
    assert table["violations"] == "0" and table["hangs"] == "0"
    assert int(table["recovered"]) == int(table["faults injected (fired)"]) > 0
    assert table["silent-fault detection"].startswith("n="), table
    # Every rank checked for silent data corruption after every step: no false positive.
    assert int(table["corruption checks (all ranks)"]) > 0 and table["sdc false positives"] == "0", table



@pytest.mark.mpi
def test_short_join_campaign_has_no_violation(tmp_path: Path) -> None:
    # Re-join on: seed 1171 draws a 3x1 job that loses its leader (rank 0) in step 0's reduction and
    # kills rank 0's first replacement while the live state reaches it (join_transfer): that attempt
    # is dropped, the next seats the replica again, and the ledger stays exact.
    cmd = [sys.executable, "-m", "benchmarks.chaos", "--joins", "--runs", "1", "--seed", "1171", "--steps", "30",
           "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    assert lines[-1].startswith("chaos: OK: 1 runs, 0 with violations"), lines[-1]
    run = next(line for line in lines if line.startswith("[1/1]"))
    assert run.startswith("[1/1] 3x1") and "rejoin" in run and "s1 r0 join_transfer kill" in run, run
    table = {k.strip(): v.strip() for k, v in (line.split("  ", 1) for line in lines if not line.startswith(("[", "chaos:")))}
    assert table["violations"] == "0" and table["hangs"] == "0", table
    assert int(table["recovered"]) == int(table["faults injected (fired)"]) == 1, table  # (a replacement's fault is not counted here)
    log = (tmp_path / "run0000" / "job.log").read_text()
    assert "re-join attempt 1 lost its replacement(s) of replica(s) [0] during the state transfer" in log, log[-4000:]
    assert "replica(s) [] re-joined" not in log and "re-join attempt 2: spawning 1 rank(s) for replica(s) [0]" in log, log[-4000:]
    assert "replica(s) [0] re-joined" in log and "alive [0, 1, 2]" in log, log[-4000:]

# ---------------------------------------------------------------------- runs on fake hosts (--hosts N)
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(3, 6), hosts=st.integers(2, 4))
def test_host_draws_spare_the_head_and_follow_the_quorum_rule(seed: int, steps: int, hosts: int) -> None:
    run, pred = draw_host_run(0, random.Random(seed), steps, hosts)
    assert 2 <= run.hosts <= hosts and run.world <= run.hosts * run.slots
    host_faults = [f for f in run.faults if f["kind"].startswith("host_")]
    rank_faults = [f for f in run.faults if not f["kind"].startswith("host_")]
    assert len(host_faults) == 1 and len(rank_faults) <= 1
    (hf,) = host_faults
    victim = run.host_of(hf["rank"])
    assert victim != 0, "the head host (mpiexec's) is never the victim"
    assert hf["kind"] in HOST_FAULT_KINDS and 1 <= hf["step"] <= steps - 2
    for f in rank_faults:
        assert run.host_of(f["rank"]) != victim and f["step"] != hf["step"] and f["step"] < steps - 1
        assert f["kind"] == "kill" or run.slots >= 2, "a stopped rank always has a watchdog beside it"
        if hf["kind"] == "host_flap":
            assert f["step"] < hf["step"], "a flap's cost is unknown in advance: nothing is scheduled after it"
    assert pred.refused is None and pred.flap == (hf["kind"] == "host_flap")
    assert pred.host_lost == (hf["kind"] == "host_kill")
    if pred.host_lost:
        # Open MPI aborts the whole job (unless the survivors finish first): a rank fault drawn after it would never fire.
        assert all(f["step"] < hf["step"] for f in rank_faults)
    if not pred.proceeds:
        # The head's side stops for want of quorum (the supervisor relaunches): those ranks are all off the victim host.
        assert pred.stopped and all(run.host_of(r) != victim for r in pred.stopped)


def _hosts_run(replicas: int, shards: int, hosts: int, slots: int, faults: list[dict]) -> ChaosRun:
    return ChaosRun(0, replicas, shards, None, grad_accum=1, steps=4, seed=0, faults=faults, hosts=hosts, slots=slots)


def test_predict_follows_the_quorum_rule() -> None:
    # 3 hosts, one replica each: a partitioned host 2 is a minority; the head's side goes on.
    assert predict(_hosts_run(3, 1, 3, 1, [{"step": 1, "rank": 2, "phase": "reduce", "kind": "host_partition"}])) == Prediction(
        True, (frozenset({0, 1}),))
    # 2 hosts x 2: rank 1 killed (certain: rank 0 survives on its host), then host 1's ranks killed: the
    # head's side (replica 0) faces two replicas it cannot check -> no side may go on (the far side is dead).
    faults = [{"step": 0, "rank": 1, "phase": "forward", "kind": "kill"}, {"step": 2, "rank": 3, "phase": "forward", "kind": "host_ranks_kill"}]
    assert predict(_hosts_run(4, 1, 2, 2, faults)) == Prediction(False, (frozenset({0, 2, 3}),), stopped=frozenset({0}))
    # The same with a partition: the cut-off side (2 replicas against 1) would go on: such a draw is refused.
    faults[1]["kind"] = "host_partition"
    assert predict(_hosts_run(4, 1, 2, 2, faults)).refused is not None
    # The same with the host frozen: no side goes on (the frozen one cannot): the head's side stops.
    faults[1]["kind"] = "host_freeze"
    assert predict(_hosts_run(4, 1, 2, 2, faults)) == Prediction(False, (frozenset({0, 2, 3}),), stopped=frozenset({0}))
    # A host lost whole (its daemon too): Open MPI aborts the job and a relaunch goes on; should the
    # survivors finish first, the rule judges the loss as that of a host out of their sight: here a stop.
    faults[1]["kind"] = "host_kill"
    assert predict(_hosts_run(4, 1, 2, 2, faults)) == Prediction(False, (frozenset({0, 2, 3}),), stopped=frozenset({0}), host_lost=True)
    assert predict(_hosts_run(3, 1, 3, 1, [{"step": 1, "rank": 2, "phase": "reduce", "kind": "host_kill"}])) == Prediction(
        True, (frozenset({0, 1}),), host_lost=True)
    # 2 replicas x 2 shards, one per host: rank 0 killed. Its mate (rank 1, the only witness on the head
    # host) leaves through the gate before or after the other replica shrinks; with it the loss is
    # certain and replica 1 goes on, without it the tie lacks the leader and replica 1 stops: refused.
    assert predict(_hosts_run(2, 2, 2, 2, [{"step": 0, "rank": 0, "phase": "forward", "kind": "kill"}])).refused is not None
    # An even split keeps the leader's side.
    assert predict(_hosts_run(2, 2, 2, 2, [{"step": 1, "rank": 2, "phase": "reduce", "kind": "host_freeze"}])) == Prediction(
        True, (frozenset({0}),))


@pytest.mark.mpi
def test_short_campaign_on_fake_hosts_has_no_violation(tmp_path: Path) -> None:
    # Seed 37 draws two supervised runs: an even split of 2 hosts x 2 (host 1 partitioned in a reduce:
    # the leader's side goes on in place, the cut-off ranks leave for want of quorum), and host 2 of 3
    # lost with its daemon after a rank kill: Open MPI aborts the job and the supervisor relaunches on
    # the 2 hosts left, from the checkpoint -- or, when the survivor commits the last steps before the
    # abort reaches it (seen in CI), the job ends in place, as the quorum rule predicts.
    cmd = [
        sys.executable, "-m", "benchmarks.chaos", "--hosts", "3", "--runs", "2", "--seed", "37", "--steps", "3",
        "--bound", "300", "--out", str(tmp_path),
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    assert lines[-1].startswith("chaos: OK: 2 runs, 0 with violations"), lines[-1]
    table = {k.strip(): v.strip() for k, v in (line.split("  ", 1) for line in lines if not line.startswith(("[", "chaos:")))}
    assert table["violations"] == "0" and table["hangs"] == "0" and table["split brains"] == "0", table
    assert table["host faults applied"] == "2", table
    assert int(table["recovered"]) == int(table["faults injected (fired)"]) == 3, table
    assert table["cut-off ranks that left (no quorum)"] == "2", table
    assert table["relaunched by the supervisor"] in ("0", "1; the host's daemon lost: 1"), table
    runs = [line for line in lines if line.startswith("[")]
    assert "went on in place" in runs[0], runs
    assert "relaunched x1 (the host's daemon lost" in runs[1] or "went on in place" in runs[1], runs
    assert int(table["corruption checks (all ranks)"]) > 0 and table["sdc false positives"] == "0", table


def test_a_last_relaunch_that_found_every_step_committed_is_idle() -> None:
    # Seen in CI: the first attempt committed all 3 steps before mpiexec's abort; the relaunch added none.
    assert last_relaunch_idle([3, 3], steps=3)
    assert not last_relaunch_idle([3], steps=3)  # no relaunch
    assert not last_relaunch_idle([1, 3], steps=3)  # the relaunch trained the rest: held to the last world
    assert not last_relaunch_idle([2, 2], steps=3)  # an unfinished job is not idle, whatever it did
    assert last_relaunch_idle([1, 3, 3], steps=3)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(4, 6), hosts=st.integers(3, 4))
def test_two_host_fault_draws_hit_two_hosts_in_order_and_follow_the_quorum_rule(seed: int, steps: int, hosts: int) -> None:
    run, pred = draw_host_run(0, random.Random(seed), steps, hosts, two_host_faults=1.0)
    assert pred.refused is None
    host_faults = [f for f in run.faults if f["kind"].startswith("host_")]
    assert 1 <= len(host_faults) <= 2 and len({f["step"] for f in run.faults}) == len(run.faults)
    if len(host_faults) == 2:
        first, second = host_faults
        assert run.hosts >= 3 and first["step"] < second["step"] <= steps - 2
        assert {first["kind"], second["kind"]} <= set(SECOND_HOST_FAULT_KINDS)
        assert 0 != run.host_of(first["rank"]) != run.host_of(second["rank"]) != 0
        assert pred.proceeds, "both host faults land while the job goes on in place"
    # Off by default: a seed's draws are those of a campaign without the option.
    assert draw_host_run(0, random.Random(seed), steps, hosts) == draw_host_run(0, random.Random(seed), steps, hosts, two_host_faults=0.0)


def test_some_seeds_draw_two_host_faults() -> None:
    rng = random.Random(5)
    draws = [draw_host_run(i, rng, 5, 3, two_host_faults=1.0)[0] for i in range(40)]
    assert sum(1 for r in draws if sum(f["kind"].startswith("host_") for f in r.faults) == 2) >= 2


# ---------------------------------------------------------------------- re-join on fake hosts (--hosts N --joins)
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(20, 40), standbys=st.integers(0, 1))
def test_host_join_draws_leave_the_spare_host_free_and_the_head_whole(seed: int, steps: int, standbys: int) -> None:
    run, pred = draw_host_join_run(0, random.Random(seed), steps, 3, standbys=standbys)
    assert run.rejoin and run.standbys == standbys and run.hosts == 3
    assert {run.host_of(r) for r in range(run.world)} == {0, 1}  # the spare host holds no rank at launch
    assert SPARE_HOST * run.slots >= run.world
    first = run.faults[0]
    assert run.host_of(first["rank"]) == 1 and first["phase"] in PHASES
    for f in run.faults:
        FaultSpec.parse(f)  # every entry is one FaultInjection accepts
        assert f["rank"] == first["rank"]  # later faults hit its replacement (on the spare host) or its attempts
        assert f is first or f["phase"] in JOIN_PHASES or f["step"] > first["step"]
        assert f["step"] <= steps - 3 or f["phase"] in JOIN_PHASES
    # The head host's replicas are never hit and hold at least half of every world: the rule lets them go on.
    head = {r // run.shards for r in range(run.world) if run.host_of(r) == 0}
    assert pred.rejoin and pred.proceeds and pred.final == (frozenset(head),) and 2 * len(head) >= run.replicas
    assert pred.host_lost == any(f["kind"] == "host_kill" for f in run.faults)


def test_host_join_draws_cover_every_kind_the_campaign_counts() -> None:
    rng = random.Random(1)
    kinds = [k for i in range(40) for k in join_draw_kinds(draw_host_join_run(i, rng, 30, 3)[0])]
    assert set(kinds) == set(JOIN_DRAW_KINDS)
    # A draw kind counts only for the faults that fired: none fired, none counted.
    run = draw_host_join_run(0, random.Random(3), 30, 3)[0]
    assert join_draw_kinds(run, fired=[]) == []


def test_host_join_draws_refuse_too_few_hosts_or_steps() -> None:
    with pytest.raises(ValueError, match="N >= 3"):
        draw_host_join_run(0, random.Random(0), 30, 2)
    with pytest.raises(ValueError, match="--steps >= 20"):
        draw_host_join_run(0, random.Random(0), 10, 3)
