"""Smoke tests of the benchmark scripts (benchmarks/common.py's launch, goodput.py, peers.py, ...) and their launched job (tiny settings).

The pure helpers run without MPI; the ``mpi`` tests launch 2-rank jobs of
``benchmarks/bench_job.py`` (a few seconds each on an idle machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest



from benchmarks import common  # noqa: E402
from benchmarks import goodput  # noqa: E402


def test_kill_plan_lands_every_k_steps_on_distinct_replicas() -> None:
    args = goodput.parse_args(["--steps", "30", "--every", "10"])
    assert goodput.kill_plan(args) == [{"step": 11, "rank": 3}, {"step": 21, "rank": 2}]
    with pytest.raises(SystemExit, match="does not land"):
        goodput.kill_plan(goodput.parse_args(["--steps", "21", "--every", "10"]))


def test_projection_scales_post_failure_steps_by_the_busiest_quota() -> None:
    run = {"wall_s": 20.0, "step_time_s": [1.0, 1.0, 1.0, 1.0], "G_cur": [2, 3, 3, 4], "extra": [0, 2, 0, 2],
           "replicas": [4, 3, 3, 2]}
    # 1 + 1.5 + 1.5 + 2 = 6 s of steps instead of 4: the wall grows by 2 s.
    assert goodput.projected_recover_wall(run, G=2) == pytest.approx(22.0)


def test_loss_deviation_compares_common_steps() -> None:
    ref = {"loss": {0: 5.0, 1: 4.0, 2: 3.0}}
    run = {"loss": {0: 5.0, 1: 4.5, 2: 3.25}}
    dev = goodput.loss_deviation(run, ref)
    assert dev["max_abs"] == pytest.approx(0.5) and dev["final_abs"] == pytest.approx(0.25)
    assert goodput.loss_deviation(run, None)["max_abs"] is None


def test_read_jsonl_skips_a_line_torn_by_a_kill(tmp_path: Path) -> None:
    p = tmp_path / "loss.jsonl"
    p.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    assert goodput.read_jsonl(p) == [{"step": 0, "loss": 1.0}]
    assert goodput.read_jsonl(tmp_path / "missing.jsonl") == []


def test_newest_checkpoint_counts_versioned_names(tmp_path: Path) -> None:
    from benchmarks import bench_job

    for name in ("ckpt-step=4.ckpt", "ckpt-step=6.ckpt", "ckpt-step=4-v1.ckpt"):
        (tmp_path / name).write_text("x")
    assert Path(bench_job.newest_checkpoint(tmp_path)).name == "ckpt-step=6.ckpt"
    assert goodput.newest_step(tmp_path) == 6
    assert bench_job.newest_checkpoint(tmp_path / "none") is None


def test_bootstrap_interval_brackets_the_ratio() -> None:
    a = [1.0, 1.1, 0.9, 1.05, 0.95] * 4
    b = [2.0, 2.2, 1.8, 2.1, 1.9] * 4
    lo, hi = common.bootstrap_ratio(a, b, n=300)
    assert lo <= 0.5 <= hi and hi < 0.7


def _losses(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out[d["step"]] = d["loss"]
    return out


@pytest.mark.mpi
def test_stock_and_recover_jobs_train_on_the_same_samples(tmp_path: Path) -> None:
    """2 ranks, 2 x 1: the stock ModelParallelStrategy job and the ReCoVer job follow one loss trajectory."""
    shared = ["--shards", "1", "--grad-accum", "2", "--mbs", "2", "--steps", "3", "--size", "tiny", "--corpus-bytes", "200000"]
    stock = common.launch(["--system", "stock", "--record-loss", *shared], tmp_path / "stock", 90, nprocs=2)
    assert stock["rc"] == 0, stock["log_tail"]
    rec = common.launch(["--system", "recover", *shared], tmp_path / "recover", 90, nprocs=2)
    assert rec["rc"] == 0, rec["log_tail"]
    ref = {d["step"]: d["loss"] for d in goodput.read_jsonl(tmp_path / "recover" / "ledger.jsonl")}
    got = _losses(tmp_path / "stock" / "loss.jsonl")
    assert sorted(got) == sorted(ref) == [0, 1, 2]
    for s in ref:
        assert got[s] == pytest.approx(ref[s], abs=1e-5)
    for d in ("stock", "recover"):
        clock = json.loads((tmp_path / d / "clock.json").read_text())
        assert clock["steps"] == [1, 2, 3] and len(clock["intervals_s"]) == 2


@pytest.mark.mpi
def test_checkpoint_restart_job_dies_once_and_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    """Plain mpiexec: the kill aborts the job; the relaunch resumes at the step-2 checkpoint and finishes."""
    args = ["--system", "cr", "--shards", "1", "--grad-accum", "2", "--mbs", "2", "--steps", "4", "--size", "tiny",
            "--corpus-bytes", "200000", "--ckpt-every", "2", "--kills", json.dumps([{"step": 3, "rank": 1}]), "--record-loss"]
    first = common.launch(args, tmp_path, 90, ft=False, nprocs=2)
    assert first["rc"] != 0 and (tmp_path / "kill0.marker").exists()
    assert goodput.newest_step(tmp_path / "ckpt") == 2
    second = common.launch(args, tmp_path, 90, ft=False, nprocs=2)
    assert second["rc"] == 0, second["log_tail"]
    lines = goodput.read_jsonl(tmp_path / "loss.jsonl")
    # steps 0, 1, 2 before the kill in step 3; step 2 is redone after resuming from the step-2 checkpoint
    assert [d["step"] for d in lines] == [0, 1, 2, 2, 3]
    assert lines[2]["loss"] == pytest.approx(lines[3]["loss"], abs=1e-6)
    starts = goodput.read_jsonl(tmp_path / "starts.jsonl")
    assert [s["step"] for s in starts] == [0, 2]


def test_checkpoint_save_benchmark_prints_the_async_sync_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import checkpoint_save

    ratio = checkpoint_save.main(["--width", "64", "--layers", "2", "--steps", "4", "--every", "2", "--dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:3]] == ["sync", "async"]
    assert lines[-1] == f"async/sync blocking time: {ratio:.2f}x" and ratio > 0
    assert not list(tmp_path.iterdir()), "the benchmark cleans up what it wrote"


def test_rejoin_benchmark_summary_reads_join_costs_and_phase_step_times_from_a_ledger() -> None:
    from benchmarks import rejoin  # benchmarks/rejoin.py

    def line(step: int, t: float, faults=(), joins=()) -> dict:
        return {"step": step, "step_time_s": t, "faults": list(faults), "joins": list(joins)}

    ledger = [line(0, 1.0), line(1, 1.0), line(2, 2.0, faults=[3]), line(3, 2.0), line(4, 2.0),
              line(5, 1.5, joins=[{"replica": 3, "pause_s": 0.2, "transfer_s": 0.1, "ok": True}]), line(6, 0.5), line(7, 0.5)]
    s = rejoin.summarize(ledger, kill_step=2)
    assert s["lost_at_step"] == 2 and s["arrival_steps"] == 3 and s["arrival_s"] == pytest.approx(6.0)
    assert (s["pause_median_s"], s["transfer_median_s"]) == (0.2, 0.1)
    assert (s["step_s_before"], s["step_s_degraded"], s["step_s_after_join"]) == (1.0, 2.0, 0.5)
    assert rejoin.summarize(ledger[:3], kill_step=2)["joins"] == []


def test_peers_kill_plan_is_checked_against_the_run() -> None:
    from benchmarks import peers  # benchmarks/peers.py

    assert peers.parse_kills("25:3, 10:1", 400) == [(10, 1), (25, 3)]
    for bad, msg in (("10", "STEP:REPLICA"), ("0:1", "must lie in"), ("10:4", "must be in"), ("10:1,12:1", "distinct"),
                     ("1:0,2:1,3:2,4:3", "at least one")):
        with pytest.raises(SystemExit, match=msg):
            peers.parse_kills(bad, 400)


def test_peers_metrics_pause_capacity_deviation_and_samples() -> None:
    from benchmarks.peers import Run, Step, metrics

    def step(s: int, t: float, loss: float = 1.0, batch: int = 8, contributors: int = 4, idx: list[int] | None = None) -> Step:
        return Step(t=t, loss=loss, batch=batch, contributors=contributors, indices=idx if idx is not None else [2 * s, 2 * s + 1])

    ref = Run("x-ff", ok=True, steps={s: step(s, 0.1 * s) for s in range(10)})
    # A kill in step 5 (fired at t = 0.45): step 5 commits 1 s late, steps 5-6 run on 3 of 4
    # replicas with a smaller batch, step 6 re-applies samples 0 and 1 instead of 12 and 13.
    steps = {s: step(s, 0.1 * s + (1.0 if s >= 5 else 0.0), loss=1.0 + (0.01 if s >= 5 else 0.0),
                     batch=6 if s in (5, 6) else 8, contributors=3 if s in (5, 6) else 4, idx=[0, 1] if s == 6 else None)
             for s in range(10)}
    m = metrics(Run("x", ok=True, steps=steps, kills=[{"step": 5, "replica": 1, "t": 0.45}]), ref, mbs=4)
    assert m["pause_s"] == [pytest.approx(1.0)] and m["capacity_back_s"] == [pytest.approx(1.25)]
    assert (m["batch_min"], m["batch_mean"]) == (6, pytest.approx(7.6)) and m["committed_samples"] == 76 * 4
    assert m["max_dloss"] == pytest.approx(0.01) and (m["samples_repeated"], m["samples_lost"]) == (2, 2)
    assert m["throughput"] == pytest.approx((76 - 8) * 4 / 1.9)
    # Without a replica coming back, capacity is never back; a restart's own gaps take precedence.
    never = {s: step(s, 0.1 * s, contributors=3 if s >= 5 else 4) for s in range(10)}
    assert metrics(Run("y", steps=never, kills=[{"step": 5, "t": 0.45}]), ref, mbs=4)["capacity_back_s"] == [None]
    cr = Run("cr", steps=dict(ref.steps), kills=[{"step": 5, "t": 0.45}], kill_gaps=[(3.1, 3.0)])
    assert metrics(cr, ref, mbs=4)["pause_s"] == [pytest.approx(3.0)]


@pytest.mark.mpi
def test_peers_quick_runs_ours_under_outside_kills_and_leaves_no_process(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``peers.py --quick`` for ReCoVer (fault-free and 2 SIGKILLs from the driver); torchft is not run in CI."""
    import time

    from benchmarks import peers
    from benchmarks.proctree import all_pids, cmdline

    def ours() -> set[int]:
        return {p for p in all_pids() if "bench_job" in cmdline(p)}

    before = ours()
    rc = peers.main(["--quick", "--systems", "recover-ff", "recover", "--quiet-wait", "0", "--out", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads((tmp_path / "p.json").read_text())
    m = res["table"]["recover"]
    assert m["steps"] == 30 and m["batch_min"] == 8 and len(res["runs"]["recover"]["kills"]) == 2
    assert m["max_dloss"] < 1e-5 and m["samples_lost"] == 0 and m["samples_repeated"] == 0
    assert all(p is not None and p < 5.0 for p in m["pause_s"])
    assert out.strip().splitlines()[-1].startswith("ReCoVer effective throughput:")
    time.sleep(0.5)
    assert not ours() - before, f"processes of the benchmark left behind: {ours() - before}"


def test_step_cost_pairs_rounds_and_takes_the_median_ratio() -> None:
    from benchmarks import step_cost  # benchmarks/step_cost.py
    from benchmarks.peers import Run, Step

    run = Run("r", steps={s: Step(t=0.1 * s + (0.05 if s == 4 else 0.0), loss=1.0, batch=8, contributors=4, indices=[])
                          for s in range(8) if s != 6})
    # Step 6 is missing (no interval across the gap); steps before --skip are left out.
    assert step_cost.step_intervals(run, skip=2) == pytest.approx([0.1, 0.15, 0.05])
    # Round 1 ran under a burst of other work: the median of the rounds' own ratios discards it.
    row = step_cost.size_row([[0.11] * 5, [0.5] * 5, [0.12] * 5], [[0.10] * 5, [0.12] * 5, [0.10] * 5])
    assert row["ratio"] == pytest.approx(1.2) and row["recover_ms"] == pytest.approx(120.0)
    assert row["round_ratios"] == pytest.approx([1.1, 0.5 / 0.12, 1.2])
    only_ours = step_cost.size_row([[0.1] * 3], [])
    assert only_ours["ratio"] is None and only_ours["torchft_ms"] is None and only_ours["recover_ms"] == pytest.approx(100.0)


@pytest.mark.mpi
def test_step_cost_quick_runs_and_prints_the_headline_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``step_cost.py --quick`` for ReCoVer (torchft is not run in CI): a fault-free run, its step time, the headline."""
    from benchmarks import step_cost

    rc = step_cost.main(["--quick", "--systems", "recover-ff", "--quiet-wait", "0", "--out", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads((tmp_path / "s.json").read_text())
    (run,) = res["runs"]
    assert run["ok"] and len(run["intervals_s"]) == 9 and res["table"]["tiny"]["recover_ms"] > 0
    assert out.strip().splitlines()[-1].startswith("ReCoVer / torchft fault-free step time: tiny ReCoVer ")


@pytest.mark.mpi
def test_mixed_world_spawns_two_replacements_and_their_world_picks_the_tcp_cap(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``mixed_world.py``: one job keeps the shared-memory cap; 2 ranks + 2 spawned ones (three MPI jobs,
    as after two re-joins) pick the TCP cap from their members' PMIx namespaces. Timings are not asserted."""
    from benchmarks import mixed_world  # benchmarks/mixed_world.py
    from lightning_recover.comm import mpi_wait

    assert mixed_world.main(["--iters", "10", "--results", str(tmp_path / "m.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines if line.startswith(("one job", "2 + 2 spawned "))]
    assert [(r[0], r[-5]) for r in rows] == [("one", f"{mpi_wait.MAX_PAUSE_S * 1e3:.2f}ms")] + [
        ("2", f"{mpi_wait.MAX_PAUSE_TCP_S * 1e3:.2f}ms")] * 2, lines
    assert lines[-1].startswith("2 + 2 spawned, step collectives at the shared-memory cap / at the TCP cap: ")
    runs = json.loads((tmp_path / "m.json").read_text())["runs"]
    assert [r["picked_cap_s"] for r in runs] == [mpi_wait.MAX_PAUSE_S, mpi_wait.MAX_PAUSE_TCP_S, mpi_wait.MAX_PAUSE_TCP_S]
    assert all(r["leftovers"] == [] for r in runs), runs  # the spawned ranks ended with their job
