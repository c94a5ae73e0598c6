"""Tests of the goodput model (benchmarks/goodput_model.py) and benchmarks/simulate.py.

The checkpoint-restart simulation is checked against **Daly's higher-order formula**
(expected wall time per segment ``M e^{R/M} (e^{(tau+delta)/M} - 1)``), which is exact in
expectation for the simulated model, at job MTBFs from the restart cost up to 1000x it
(tolerance: 5% of the waste, >= 3.5 standard errors at every point); and against the
first-order Young/Daly waste ``delta/tau + (tau/2 + R)/M`` where it applies (M >= 100 R).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st



from benchmarks import simulate  # noqa: E402
from benchmarks.goodput_model import (  # noqa: E402
    DAY,
    HOUR,
    ModelParams,
    daly_goodput,
    daly_interval,
    first_order_waste,
    fluid_throughput,
    job_mtbf_s,
    make_rng,
    pause_from_ledger,
    quantised_throughput,
    rejoin_pause_from_ledger,
    replica_goodput_estimate,
    simulate_checkpoint_restart,
    simulate_job,
    simulate_replicas,
    young_daly_interval,
)

R = 600.0  # restart cost, s
DELTA = 60.0  # checkpoint write, s


def _cr_waste(mtbf_s: float, wall_mult: float, runs: int) -> float:
    tau = young_daly_interval(DELTA, mtbf_s)
    gs = [
        simulate_checkpoint_restart(mtbf_s, tau, DELTA, R, wall_mult * mtbf_s, make_rng("daly", mtbf_s, i)).goodput
        for i in range(runs)
    ]
    return 1.0 - sum(gs) / len(gs)


# job MTBF in minutes, simulated wall time in job MTBFs, runs
@pytest.mark.parametrize("mtbf_min, wall_mult, runs", [(10, 20_000, 4), (30, 20_000, 2), (100, 10_000, 4),
                                                        (1000, 4000, 1), (10_000, 4000, 1)])
def test_checkpoint_restart_matches_daly_higher_order(mtbf_min: float, wall_mult: float, runs: int) -> None:
    m = mtbf_min * 60.0
    tau = young_daly_interval(DELTA, m)
    expected = 1.0 - daly_goodput(m, tau, DELTA, R)
    got = _cr_waste(m, wall_mult, runs)
    assert got == pytest.approx(expected, rel=0.05), (mtbf_min, got, expected)


@pytest.mark.parametrize("mtbf_min", [1000, 10_000])
def test_checkpoint_restart_matches_first_order_when_mtbf_is_long(mtbf_min: float) -> None:
    m = mtbf_min * 60.0
    tau = young_daly_interval(DELTA, m)
    got = _cr_waste(m, 4000, 1)
    assert got == pytest.approx(first_order_waste(m, tau, DELTA, R), rel=0.05)


def test_daly_formulas() -> None:
    m = 30 * 60.0
    assert young_daly_interval(60, m) == pytest.approx(math.sqrt(2 * 60 * m))
    # Daly's optimum is close to Young's when delta << M and maximises the closed form better.
    t_d = daly_interval(60, m)
    assert t_d == pytest.approx(young_daly_interval(60, m), rel=0.1)
    assert daly_goodput(m, t_d, 60, R) >= daly_goodput(m, young_daly_interval(60, m), 60, R) - 1e-12
    assert daly_interval(60, 20.0) == 20.0  # delta >= 2M: checkpoint every MTBF
    # the closed form tends to the first-order one as M grows
    big = 1e7
    tau = young_daly_interval(60, big)
    assert 1 - daly_goodput(big, tau, 60, R) == pytest.approx(first_order_waste(big, tau, 60, R), rel=5e-3)
    assert daly_goodput(1.0, 60.0, 60.0, 1e6) == 0.0  # overflow is goodput 0, not an error
    assert job_mtbf_s(100_000, 50_000 * HOUR) == pytest.approx(1800.0)


def test_zero_failures_give_goodput_one_for_all() -> None:
    params = ModelParams(gpu_mtbf_s=math.inf)
    r = simulate_job(4096, params, 10 * DAY, reps=2)
    assert r.checkpoint_restart.mean == 1.0
    assert r.adaptive.mean == 1.0
    assert r.recover.mean == 1.0
    assert r.daly_goodput == 1.0 and r.recover_estimate == 1.0
    assert r.adaptive_batch_min.mean == 1.0 and r.adaptive_full_batch_share.mean == 1.0
    assert r.failures_per_run == 0 and r.ratio == 1.0
    assert math.isinf(r.tau_s)


def test_recover_beats_checkpoint_restart_when_mtbf_is_near_restart_cost() -> None:
    gpus = 8000
    params = ModelParams(gpu_mtbf_s=gpus * R, restart_s=R)  # job MTBF = R = 10 min
    r = simulate_job(gpus, params, 5 * DAY, reps=2)
    assert r.job_mtbf_s == pytest.approx(R)
    assert r.checkpoint_restart.mean == pytest.approx(r.daly_goodput, abs=0.03)
    assert r.checkpoint_restart.mean < 0.3
    assert r.recover.mean > 0.95
    assert r.recover.mean > r.adaptive.mean > r.checkpoint_restart.mean
    assert r.ratio > 3.0


def test_replica_simulation_matches_estimate_and_reports_drift() -> None:
    params = ModelParams()
    r = simulate_job(100_000, params, 30 * DAY, reps=4)
    assert r.recover.mean == pytest.approx(r.recover_estimate, abs=5e-4)
    aw_est = replica_goodput_estimate(100_000, 8, params.gpu_mtbf_s, 60.0, params.repair_s, 5.0, 30 * DAY)
    assert r.adaptive.mean == pytest.approx(aw_est, abs=2e-3)
    # AdaptiveWorld divides by survivors: at 100k GPUs about one replica is down on average
    # (2 failures/h x 30 min repair), so most steps run below the target batch.
    assert 0.25 < r.adaptive_full_batch_share.mean < 0.55
    assert r.adaptive_batch_min.mean < 1.0
    assert r.adaptive_batch_mean.mean == pytest.approx(1 - 8 * 0.5 / 50_000 * 1, abs=2e-5)


def test_recover_with_and_without_rejoin() -> None:
    # The point: without re-join, lost replicas accumulate, and at 1k GPUs ReCoVer
    # falls behind checkpoint-restart over 30 days; with re-join it is ahead.
    r = simulate_job(1024, ModelParams(), 30 * DAY, reps=20)
    assert r.ratio_no_rejoin < 0.99 and r.ratio > 1.01, (r.ratio_no_rejoin, r.ratio)
    assert r.recover_no_rejoin.mean == pytest.approx(r.recover_no_rejoin_estimate, abs=5e-3)
    assert r.recover_no_rejoin.mean < r.recover.mean
    assert r.extra["recover_rejoins_per_run"] > 0
    d = r.as_dict()
    assert d["ratio_recover_no_rejoin_over_checkpoint_restart"] == r.ratio_no_rejoin
    assert d["ratio_recover_over_checkpoint_restart"] == r.ratio


def test_recover_join_pause_is_recovers_own() -> None:
    # A measured join pause moves ReCoVer with re-join only: AdaptiveWorld keeps the assumed
    # rejoin_pause_s, and ReCoVer without re-join never pauses for a join.
    base = simulate_job(100_000, ModelParams(), 3 * DAY, reps=1)
    slow = simulate_job(100_000, ModelParams(recover_rejoin_pause_s=60.0), 3 * DAY, reps=1)
    assert ModelParams(recover_rejoin_pause_s=60.0).recover_join_pause_s == 60.0
    assert ModelParams(rejoin_pause_s=7.0).recover_join_pause_s == 7.0
    assert slow.recover.mean < base.recover.mean
    assert slow.adaptive == base.adaptive
    assert slow.recover_no_rejoin == base.recover_no_rejoin
    never = simulate_job(1024, ModelParams(repair_s=math.inf), 3 * DAY, reps=2)
    assert never.recover == never.recover_no_rejoin and never.ratio == never.ratio_no_rejoin


def test_salvage_reforms_replicas_from_orphans() -> None:
    # Without re-join, a lost replica never comes back whole, but orphans of different shard
    # indices re-form one: salvage keeps most of the capacity the plain system loses.
    r = simulate_job(10_240, ModelParams(), 30 * DAY, reps=4)
    assert r.recover_salvage is not None and r.recover_salvage_no_rejoin is not None
    assert r.recover_salvage_no_rejoin.mean > r.recover_no_rejoin.mean + 0.02, (r.recover_salvage_no_rejoin, r.recover_no_rejoin)
    assert r.extra["recover_salvage_reformations_per_run"] > 0
    assert r.recover_salvage.mean == pytest.approx(r.recover.mean, abs=2e-3), "with re-join both get the capacity back"
    # One GPU per replica: no orphan is ever left, so a replica comes back only by repair.
    run = simulate_replicas(16, 1, 200 * HOUR, 0.05, math.inf, 5.0, 30 * DAY, make_rng("salvage-g1"), salvage=True)
    assert run.rejoins == 0 and run.batch_fraction_min == pytest.approx((16 - run.failures) / 16)
    quiet = simulate_replicas(16, 8, math.inf, 0.05, 1800.0, 5.0, DAY, make_rng("quiet"), salvage=True)
    assert quiet.goodput == 1.0 and quiet.failures == quiet.rejoins == 0


def test_recover_without_rejoin_only_shrinks() -> None:
    run = simulate_replicas(16, 8, 200 * HOUR, 0.05, math.inf, 5.0, 30 * DAY, make_rng("norejoin"))
    assert run.rejoins == 0
    assert run.batch_fraction_min == pytest.approx((16 - run.failures) / 16)
    est = replica_goodput_estimate(128, 8, 200 * HOUR, 0.05, math.inf, 5.0, 30 * DAY)
    assert 0 < run.goodput < 1 and est < 1


def test_quantised_throughput() -> None:
    thr = quantised_throughput(1)
    assert thr(100, 100) == 1.0
    assert thr(99, 100) == 0.5  # G=1: one loss doubles every survivor's step
    assert thr(0, 100) == 0.0
    thr4 = quantised_throughput(4)
    assert thr4(99, 100) == pytest.approx(4 / 5)
    assert quantised_throughput(10_000)(90, 100) == pytest.approx(fluid_throughput(90, 100), rel=1e-3)
    params = ModelParams(grad_accum=1)
    assert simulate_job(100_000, params, 3 * DAY, reps=1).recover.mean < simulate_job(
        100_000, ModelParams(), 3 * DAY, reps=1
    ).recover.mean


def test_goodput_increases_with_mtbf_in_simulation() -> None:
    mtbfs_h = [2_500, 10_000, 40_000, 160_000]
    rows = [simulate_job(32_768, ModelParams(gpu_mtbf_s=h * HOUR), 20 * DAY, reps=3, seed=1) for h in mtbfs_h]
    for attr in ("checkpoint_restart", "adaptive", "recover"):
        values = [getattr(r, attr).mean for r in rows]
        assert values == sorted(values) and len(set(values)) == len(values), (attr, values)


@settings(max_examples=200, deadline=None)
@given(
    m1=st.floats(min_value=60.0, max_value=1e8),
    factor=st.floats(min_value=1.001, max_value=100.0),
    delta=st.floats(min_value=1.0, max_value=3600.0),
    restart=st.floats(min_value=0.0, max_value=7200.0),
)
def test_closed_form_goodput_is_monotone_in_mtbf(m1: float, factor: float, delta: float, restart: float) -> None:
    m2 = m1 * factor
    for rule in (young_daly_interval, daly_interval):
        g1 = daly_goodput(m1, rule(delta, m1), delta, restart)
        g2 = daly_goodput(m2, rule(delta, m2), delta, restart)
        assert 0.0 <= g1 <= g2 <= 1.0
    e1 = replica_goodput_estimate(16_384, 8, m1 * 16_384, 0.05, restart, 5.0, 30 * DAY)
    e2 = replica_goodput_estimate(16_384, 8, m2 * 16_384, 0.05, restart, 5.0, 30 * DAY)
    assert 0.0 <= e1 <= e2 <= 1.0


@settings(max_examples=30, deadline=None)
@given(
    mtbf_h=st.floats(min_value=1.0, max_value=1e6),
    replicas=st.integers(min_value=1, max_value=64),
    pause=st.floats(min_value=0.0, max_value=600.0),
    repair_min=st.floats(min_value=0.0, max_value=600.0),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_replica_simulation_bounds(mtbf_h: float, replicas: int, pause: float, repair_min: float, seed: int) -> None:
    run = simulate_replicas(replicas, 8, mtbf_h * HOUR, pause, repair_min * 60, 1.0, 2 * DAY, make_rng(seed))
    assert 0.0 <= run.goodput <= 1.0
    assert 0.0 <= run.batch_fraction_min <= run.batch_fraction_mean + 1e-12
    assert run.batch_fraction_mean <= 1.0
    assert 0.0 <= run.full_batch_share <= 1.0
    assert run.rejoins <= run.failures
    assert 0.0 <= run.paused_s <= 2 * DAY


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: ModelParams(gpu_mtbf_s=-5.0), "gpu_mtbf_s"),
        (lambda: ModelParams(gpu_mtbf_s=0.0), "gpu_mtbf_s"),
        (lambda: ModelParams(checkpoint_s=0.0), "checkpoint_s"),
        (lambda: ModelParams(restart_s=-1.0), "restart_s"),
        (lambda: ModelParams(repair_s=float("nan")), "repair_s"),
        (lambda: ModelParams(gpus_per_replica=0), "gpus_per_replica"),
        (lambda: ModelParams(interval="fast"), "interval"),
        (lambda: ModelParams(recover_overhead=1.5), "recover_overhead"),
        (lambda: ModelParams(recover_rejoin_pause_s=-1.0), "recover_rejoin_pause_s"),
        (lambda: job_mtbf_s(0, 1.0), "gpus"),
        (lambda: simulate_job(1000, ModelParams(gpus_per_replica=16), DAY, 1), "gpus_per_replica=16"),
        (lambda: simulate_checkpoint_restart(-3.0, 60, 60, 600, DAY, make_rng(0)), "mtbf_s"),
        (lambda: simulate_checkpoint_restart(60.0, 60, 60, 600, 1e12, make_rng(0)), "events"),
        (lambda: quantised_throughput(0), "grad_accum"),
    ],
)
def test_bad_values_are_named(call: Callable[[], object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


def test_negative_mtbf_message_shows_value() -> None:
    with pytest.raises(ValueError, match=r"gpu_mtbf_s must be > 0 \(got -5"):
        ModelParams(gpu_mtbf_s=-5.0)


def _ledger(
    path: Path, recs: list[tuple[list[int], float]], joins: dict[int, list[dict[str, Any]]] | None = None
) -> Path:
    """A ledger with the fields the simulator reads; ``joins`` maps a step to its ``joins`` list."""
    with open(path, "w") as f:
        for step, (faults, rec) in enumerate(recs):
            line: dict[str, Any] = {"step": step, "faults": faults, "recovery_s": rec}
            if joins and step in joins:
                line["joined"] = [j["replica"] for j in joins[step]]
                line["joins"] = joins[step]
            f.write(json.dumps(line) + "\n")
    return path


# Two faults, then three joins with measured pauses (median 1.5 s, mean 3.67 s) and one whose
# pause was not measured (null): the simulator must take the median of the measured ones.
FAULTS = [([], 0.0), ([1], 0.08), ([], 0.0), ([3], 0.12), ([], 0.0), ([], 0.0)]
JOINS = {
    2: [{"replica": 1, "transfer_s": 0.9, "pause_s": 0.5}],
    4: [{"replica": 3, "transfer_s": 1.1, "pause_s": 9.0}, {"replica": 1, "transfer_s": 1.0, "pause_s": None}],
    5: [{"replica": 2, "transfer_s": 1.2, "pause_s": 1.5}],
}


def test_pause_from_ledger(tmp_path: Path) -> None:
    p = _ledger(tmp_path / "ledger.jsonl", [([], 0.0), ([2], 0.2), ([], 0.0), ([1, 3], 0.4), ([0], 0.0)])
    mean, n = pause_from_ledger(p)
    assert mean == pytest.approx(0.3) and n == 2
    empty = _ledger(tmp_path / "none.jsonl", [([], 0.0)])
    with pytest.raises(ValueError, match="none.jsonl"):
        pause_from_ledger(empty)


def test_rejoin_pause_from_ledger(tmp_path: Path) -> None:
    assert rejoin_pause_from_ledger(_ledger(tmp_path / "j.jsonl", FAULTS, JOINS)) == (1.5, 3)
    assert rejoin_pause_from_ledger(_ledger(tmp_path / "none.jsonl", FAULTS)) is None
    unmeasured = {2: [{"replica": 1, "transfer_s": 0.9, "pause_s": None}]}
    assert rejoin_pause_from_ledger(_ledger(tmp_path / "null.jsonl", FAULTS, unmeasured)) is None
    bad = {2: [{"replica": 1, "transfer_s": 0.9, "pause_s": -2.0}]}
    with pytest.raises(ValueError, match=r"bad.jsonl: step 2: join pause_s must be seconds >= 0 or null, got -2.0"):
        rejoin_pause_from_ledger(_ledger(tmp_path / "bad.jsonl", FAULTS, bad))


def test_cli_takes_join_pause_from_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = _ledger(tmp_path / "ledger.jsonl", FAULTS, JOINS)
    out = tmp_path / "sim.json"
    argv = ["--job-sizes", "1024", "--days", "2", "--reps", "1", "--out", str(out), "--no-figure"]
    args = simulate.parse_args([*argv, "--ledger", str(ledger)])  # --ledger: --pause-from's alias
    assert args.pause_s == pytest.approx(0.1) and args.recover_rejoin_pause_s == 1.5 and args.joins == 3
    assert simulate.main([*argv, "--pause-from", str(ledger)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith(f"ReCoVer per job size (fault pause: measured: mean recovery_s of 2 faulted steps of {ledger} + ")
               for line in lines), lines
    inputs = json.loads(out.read_text())["recover_inputs"][0]
    # The ledger's pause replaces the control plane's share; the bookkeeping's growth is added to it.
    assert inputs["pause_s"] == pytest.approx(0.1 + inputs["bookkeeping_loss_s"]) and inputs["bookkeeping_loss_s"] > 0
    assert any(line.startswith(f"ReCoVer join pause: 1.5 s (measured: median pause_s of 3 joins in {ledger}); ")
               for line in lines), lines
    assert "(after 30 min, 1.5 s join pause)" in lines[-1]
    data = json.loads(out.read_text())
    assert data["params_s"]["recover_rejoin_pause_s"] == 1.5
    assert data["params_s"]["rejoin_pause_s"] == 5.0  # AdaptiveWorld keeps the assumed pause


def test_cli_falls_back_when_ledger_has_no_joins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = _ledger(tmp_path / "ledger.jsonl", FAULTS)
    out = tmp_path / "sim.json"
    rc = simulate.main(["--job-sizes", "1024", "--days", "2", "--reps", "1", "--pause-from", str(ledger),
                        "--rejoin-pause-s", "7", "--out", str(out), "--no-figure"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith(f"ReCoVer join pause: 7 s (--rejoin-pause-s, assumed: {ledger} records no join "
                               f"with a measured pause_s") for line in lines), lines
    assert "(after 30 min, 7 s join pause)" in lines[-1]
    assert json.loads(out.read_text())["params_s"]["recover_rejoin_pause_s"] == 7.0


@pytest.mark.plots
def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = _ledger(tmp_path / "ledger.jsonl", [([], 0.0), ([1], 0.08)])
    out, fig = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = simulate.main(["--job-sizes", "1024", "100000", "--days", "3", "--reps", "2", "--pause-from", str(ledger),
                        "--out", str(out), "--figure", str(fig)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    m = re.fullmatch(r"ReCoVer over 3 days without / with re-join \(after 30 min, 5 s join pause\): goodput "
                     r"(\d\.\d{3}) / (\d\.\d{3}) at 100k GPUs \(torchft-like \d\.\d{3}, FT-HSDP \d\.\d{3}, "
                     r"checkpoint-restart \d\.\d{3}\); vs checkpoint-restart (\d+\.\d\d)x / (\d+\.\d\d)x "
                     r"at 1k GPUs, (\d+\.\d\d)x / (\d+\.\d\d)x at 100k GPUs; with salvage (\d\.\d{3}) / (\d\.\d{3})", lines[-1])
    assert m, lines[-1]
    data = json.loads(out.read_text())
    assert [r["gpus"] for r in data["rows"]] == [1024, 100_000]
    assert data["params_s"]["recover_pause_s"] == pytest.approx(0.08)
    assert data["headline"] == lines[-1]
    small, large = data["rows"]
    assert [float(x) for x in m.groups()] == [
        round(large["recover_no_rejoin"]["mean"], 3), round(large["recover"]["mean"], 3),
        round(small["ratio_recover_no_rejoin_over_checkpoint_restart"], 2),
        round(small["ratio_recover_over_checkpoint_restart"], 2),
        round(large["ratio_recover_no_rejoin_over_checkpoint_restart"], 2),
        round(large["ratio_recover_over_checkpoint_restart"], 2),
        round(large["recover_salvage_no_rejoin"]["mean"], 3), round(large["recover_salvage"]["mean"], 3),
    ]
    assert fig.stat().st_size > 10_000


def test_cli_no_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = simulate.main(["--gpu-mtbf-h", "inf", "--job-sizes", "4096", "--days", "1", "--reps", "1",
                        "--out", str(tmp_path / "s.json"), "--no-figure"])
    assert rc == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(
        "goodput 1.000 / 1.000 at 4k GPUs (torchft-like 1.000, FT-HSDP 1.000, checkpoint-restart 1.000); "
        "vs checkpoint-restart 1.00x / 1.00x at 4k GPUs; with salvage 1.000 / 1.000")


def test_recover_pause_and_overhead_come_from_measurements_per_job_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --pause-s: the control-plane model and scale.py's fitted bookkeeping give each size its own numbers."""
    out = tmp_path / "s.json"
    assert simulate.main(["--job-sizes", "1024", "100000", "--days", "1", "--reps", "1", "--out", str(out), "--no-figure"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("fault pause: control-plane model (benchmarks/control_plane_model.py) + the bookkeeping" in line and
               "bookkeeping fitted from" in line for line in lines), lines
    data = json.loads(out.read_text())
    small, large = data["recover_inputs"]
    assert set(data["fits"]) == {"rank_step_s", "engine_loss_s", "engine_replan_s", "join64_s"}
    for i in (small, large):
        assert i["pause_s"] == pytest.approx(i["control_plane_pause_s"] + i["bookkeeping_loss_s"])
        assert 0 < i["overhead"] < 0.01
    # Both shares grow with the job, neither as fast as the job.
    assert small["pause_s"] < large["pause_s"] < 100 * small["pause_s"]
    assert small["bookkeeping_loss_s"] < large["bookkeeping_loss_s"]
    assert data["rows"][1]["ft_hsdp"]["mean"] < data["rows"][1]["recover"]["mean"]


def test_a_missing_scale_result_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        simulate.main(["--scale-from", str(tmp_path / "none.json"), "--no-figure"])
    assert exc.value.code == 2 and "run python -m benchmarks.scale to measure it" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--gpu-mtbf-h", "-5"], "--gpu-mtbf-h"),
        (["--checkpoint-min", "0"], "--checkpoint-min"),
        (["--restart-min", "-1"], "--restart-min"),
        (["--pause-s", "-0.1"], "--pause-s"),
        (["--job-sizes", "1000", "1001"], "--job-sizes"),
        (["--reps", "0"], "--reps"),
        (["--pause-from", "/nonexistent/ledger.jsonl"], "--pause-from"),
        (["--ledger", "/nonexistent/ledger.jsonl"], "--pause-from"),
    ],
)
def test_cli_rejects_bad_values(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        simulate.parse_args(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
