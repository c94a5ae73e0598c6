"""End-to-end tests of ReCoVerHSDPStrategy: launched jobs, tiny GPT, real SIGKILLs.

Nothing here asserts wall-clock time; recovery pauses are read from the ledger and reported.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger
from lightning_recover.callbacks import resolve_ckpt_path
from harness.mpirun import MPIJob, run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/train_worker.py"
STEPS = 4
TOPOLOGIES = {"4x1": (4, ["--shards", "1"]), "2x2": (4, ["--shards", "2"])}


def launch(out: Path, n: int, args: list[str], faults: list[dict] | None = None) -> MPIJob:
    argv = [WORKER, "--steps", str(STEPS), *args]
    if faults:
        argv += ["--faults", json.dumps(faults)]
    job = run_mpi(n, argv, out, timeout=240)
    assert (out / "ledger.jsonl").exists(), job.describe()
    return job


def losses(out: Path) -> list[float]:
    return [line["loss"] for line in read_ledger(out / "ledger.jsonl")]


def survivor_params(job: MPIJob) -> dict[int, dict[str, torch.Tensor]]:
    return {int(f.stem[6:]): torch.load(f) for f in sorted(job.outdir.glob("params*.pt"))}


def assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MPIJob]:
    runs = {}
    for name, (n, args) in TOPOLOGIES.items():
        runs[name] = launch(tmp_path_factory.mktemp(f"ff{name}"), n, args)
    return runs


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_fault_free_matches_single_process_accumulation(fault_free: dict[str, MPIJob], topology: str) -> None:
    from reference import reference_run

    n, args = TOPOLOGIES[topology]
    job = fault_free[topology]
    replicas = n // int(args[1])
    ref_losses, ref_params = reference_run(["--steps", str(STEPS), *args], replicas)
    assert losses(job.outdir) == pytest.approx(ref_losses, rel=1e-5)
    params = survivor_params(job)
    assert len(params) == replicas
    for p in params.values():
        assert_params_close(p, ref_params, rtol=1e-5, atol=1e-6)
    verdict = check_ledger(job.outdir / "ledger.jsonl")
    assert verdict.ok, verdict.problems
    # Every step reduced across replicas during its last backward (recover.overlap defaults on).
    assert [line["overlapped"] for line in read_ledger(job.outdir / "ledger.jsonl")] == [True] * STEPS
    # The ledger records the run's precision, which check-ledger fits its loss tolerance to.
    assert {line["precision"] for line in read_ledger(job.outdir / "ledger.jsonl")} == {"32-true"}
    # On CPU with the MPI data plane, FSDP2's in-replica collectives ran on MPI (replica_plane=auto).
    results = job.results().values()
    assert {res["replica_plane"] for res in results} == {"mpi"}
    if int(args[1]) > 1:
        assert all(res["replica_plane_calls"] > 0 for res in results)
    # torchmetrics state syncs across all live ranks, not just inside the replica.
    samples = {res["samples_seen"] for res in job.results().values()}
    per_mb = 2 * int(args[1])  # --mbs 2 per shard rank
    assert samples == {float(STEPS * replicas * 2 * per_mb)}, samples


def test_replicas_start_from_one_state_even_unseeded(tmp_path: Path) -> None:
    from reference import reference_run

    job = launch(tmp_path, 4, ["--unseeded"])
    ref_losses, _ = reference_run(["--steps", str(STEPS)], 4)  # rank 0's initial weights
    assert losses(job.outdir) == pytest.approx(ref_losses, rel=1e-5)
    digests = {tuple(float(v.sum()) for v in p.values()) for p in survivor_params(job).values()}
    assert len(digests) == 1


def check_recovered_run(job: MPIJob, reference: MPIJob, expect_faults: int) -> list[dict]:
    ledger = read_ledger(job.outdir / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(STEPS)), job.describe()
    verdict = check_ledger(job.outdir / "ledger.jsonl", reference=str(reference.outdir / "ledger.jsonl"), rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{job.describe()}"
    assert sum(len(line["faults"]) for line in ledger) == expect_faults
    params = survivor_params(job)
    first = next(iter(params.values()))
    for rank, p in params.items():  # survivors hold bitwise-identical parameters
        for k in first:
            assert torch.equal(p[k], first[k]), f"rank {rank} differs from the other survivors in {k}"
    assert_params_close(first, next(iter(survivor_params(reference).values())), rtol=1e-4, atol=1e-4)
    # A torchmetrics SumMetric updated in training_step ends with the fault-free run's total (issue 34):
    # every committed microbatch counted once, the lost replica's part of the run kept, shadows not counted.
    samples = {res["samples_seen"] for res in job.results().values()}
    assert samples == {res["samples_seen"] for res in reference.results().values()}, samples
    return ledger


@pytest.mark.parametrize("phase", ["forward", "backward", "reduce", "optimizer"])
def test_one_kill_in_each_phase_2x2(tmp_path: Path, fault_free: dict[str, MPIJob], phase: str) -> None:
    n, args = TOPOLOGIES["2x2"]
    job = launch(tmp_path, n, args, [{"step": 1, "rank": 2, "phase": phase, "kind": "kill"}])
    ledger = check_recovered_run(job, fault_free["2x2"], expect_faults=1)
    lost_at = 2 if phase == "optimizer" else 1  # an optimizer-phase death is seen at the next step's reduce
    assert ledger[lost_at]["faults"] == [1]
    assert ledger[lost_at]["world_epoch"] == 1
    print(f"2x2 {phase}: recovery pause {ledger[lost_at]['recovery_s']:.3f}s")


@pytest.mark.parametrize("phases", [("forward", "reduce"), ("backward", "optimizer")])
def test_kills_in_each_phase_4x1(tmp_path: Path, fault_free: dict[str, MPIJob], phases: tuple[str, str]) -> None:
    # Two kills per job (4 replicas): replica 1 in step 1, replica 2 in step 2 (an optimizer-phase
    # death in step 1 instead: it is seen at step 2's reduce). The 4x1 "reduce" kill lands in
    # the overlapped round, while backward still runs.
    first, second = phases
    second_step = 1 if second == "optimizer" else 2
    n, args = TOPOLOGIES["4x1"]
    job = launch(tmp_path, n, args, [
        {"step": 1, "rank": 1, "phase": first, "kind": "kill"},
        {"step": second_step, "rank": 2, "phase": second, "kind": "kill"},
    ])
    ledger = check_recovered_run(job, fault_free["4x1"], expect_faults=2)
    assert [line["faults"] for line in ledger] == [[], [1], [2], []]
    assert [line["world_epoch"] for line in ledger] == [0, 1, 2, 2]
    print(f"4x1 {phases}: recovery pauses {ledger[1]['recovery_s']:.3f}s, {ledger[2]['recovery_s']:.3f}s")


def test_a_sigterm_and_a_sigkill_in_the_same_step(tmp_path: Path, fault_free: dict[str, MPIJob]) -> None:
    # 4x1, step 1: rank 1 gets SIGTERM in its backward (a node drained, or mpiexec ending ranks)
    # while rank 2 is SIGKILLed in the reduce. SIGTERM ends a rank at once, like a kill (never
    # Lightning's deferred exit, whose broadcast no other rank joins): one repair of step 1
    # drops both replicas, and the run stays on the fault-free trajectory.
    n, args = TOPOLOGIES["4x1"]
    job = launch(tmp_path, n, args, [
        {"step": 1, "rank": 1, "phase": "backward", "kind": "term"},
        {"step": 1, "rank": 2, "phase": "reduce", "kind": "kill"},
    ])
    assert job.returncode == 0, job.describe()
    ledger = check_recovered_run(job, fault_free["4x1"], expect_faults=2)
    assert [line["faults"] for line in ledger] == [[], [1, 2], [], []], job.describe()
    assert ledger[-1]["replicas"] == [0, 3], job.describe()
    assert sorted(survivor_params(job)) == [0, 3], job.describe()
    assert "fault injection: term rank 1 at step 1 backward" in job.stderr, job.describe()


@pytest.mark.parametrize(
    ("topology", "faults", "lost"),
    [
        # 2x2: rank 2 dies in the middle of the reduce (buckets 0-4 done, then stale); its
        # replica-mate leaves through the gate; each shard index has its own gloo group.
        ("2x2", [{"step": 1, "rank": 2, "phase": "reduce", "bucket": 5, "kind": "kill"}], {1: [1]}),
        # 4x1: the leader (the host of the groups' store) dies mid-reduce; then rank 2 is
        # SIGSTOPped before a bucket while the others wait inside gloo, where no MPI revoke
        # reaches them: the hang watchdog kills it, ULFM notices, the group is abandoned.
        ("4x1", [{"step": 1, "rank": 0, "phase": "reduce", "bucket": 5, "kind": "kill"},
                 {"step": 2, "rank": 2, "phase": "reduce", "bucket": 3, "kind": "hang"}], {1: [0], 2: [2]}),
    ],
)
def test_gloo_data_plane_recovers_on_the_fault_free_trajectory(
    tmp_path: Path, fault_free: dict[str, MPIJob], topology: str, faults: list[dict], lost: dict[int, list[int]]
) -> None:
    n, args = TOPOLOGIES[topology]
    argv = [WORKER, "--steps", str(STEPS), *args, "--data-plane", "gloo", "--faults", json.dumps(faults)]
    job = run_mpi(n, argv, tmp_path, timeout=240, hang_timeout=4)
    assert (tmp_path / "ledger.jsonl").exists(), job.describe()
    ledger = check_recovered_run(job, fault_free[topology], expect_faults=sum(len(v) for v in lost.values()))
    assert {i: line["faults"] for i, line in enumerate(ledger) if line["faults"]} == lost
    results = job.results()
    # The last world epoch's gloo group carried the buckets on every survivor.
    assert all(r["data_plane"] == "gloo" and r["data_plane_buckets"] > 0 for r in results.values()), results
    assert {r["epoch"] for r in results.values()} == {len(lost)}
    if any(f["kind"] == "hang" for f in faults):
        assert "killing rank 2" in job.stderr, job.describe()
    else:
        assert "replica-consistency gate" in job.stderr, job.describe()


def test_spare_absorbs_a_contributor_loss(tmp_path: Path, fault_free: dict[str, MPIJob]) -> None:
    # 5 replicas, target 4: B = 8 as in the 4x1 fault-free run, replica 4 shadows replica 0.
    job = launch(tmp_path, 5, ["--target", "4"], [{"step": 1, "rank": 0, "phase": "backward", "kind": "kill"}])
    ledger = check_recovered_run(job, fault_free["4x1"], expect_faults=1)
    assert ledger[0]["roles"]["4"] == "major_spare"
    assert ledger[1]["faults"] == [0]
    assert ledger[1]["extra_microbatches"] == 0, "a shadowed contributor's loss must cost no extra microbatch"
    assert ledger[1]["roles"]["4"] == "major"


def test_cascade_during_boundary_step(tmp_path: Path, fault_free: dict[str, MPIJob]) -> None:
    # Replica 1 dies in the reduce; while the survivors run the boundary step's extra
    # microbatches (each replica's 3rd microbatch of the step), replica 2 dies too.
    faults = [
        {"step": 1, "rank": 1, "phase": "reduce", "kind": "kill"},
        {"step": 1, "rank": 2, "phase": "forward", "microbatch": 2, "kind": "kill"},
    ]
    job = launch(tmp_path, 4, [], faults)
    ledger = check_recovered_run(job, fault_free["4x1"], expect_faults=2)
    assert sorted(ledger[1]["faults"]) == [1, 2]
    assert ledger[1]["world_epoch"] == 2
    assert ledger[1]["extra_microbatches"] == 4  # the 4 ids of replicas 1 and 2 replayed by 0 and 3


def test_rank_zero_replica_killed_leadership_moves(tmp_path: Path, fault_free: dict[str, MPIJob]) -> None:
    job = launch(tmp_path, 4, [], [{"step": 1, "rank": 0, "phase": "backward", "kind": "kill"}])
    check_recovered_run(job, fault_free["4x1"], expect_faults=1)
    results = job.results()
    assert sorted(results) == [1, 2, 3]
    assert [r for r, res in results.items() if res["leader"]] == [1]
    metrics = next(job.outdir.glob("logs/version_*/metrics.csv"))
    steps = {int(row["step"]) for row in csv.DictReader(metrics.open()) if row.get("step_loss")}
    # Rows of the old leader (steps 0, 1) survive and the new leader continues the same file.
    assert steps == set(range(STEPS)), f"metrics.csv has steps {sorted(steps)}, expected 0..{STEPS - 1}"


def test_user_recovery_callback_sees_each_lost_replica_once_with_its_world_epoch(
    tmp_path: Path, fault_free: dict[str, MPIJob]
) -> None:
    # Replica 1 dies in step 1's backward, then the leader's replica 0 in step 2's reduce.
    faults = [
        {"step": 1, "rank": 1, "phase": "backward", "kind": "kill"},
        {"step": 2, "rank": 0, "phase": "reduce", "kind": "kill"},
    ]
    job = launch(tmp_path, 4, ["--alerts"], faults)
    check_recovered_run(job, fault_free["4x1"], expect_faults=2)
    for rank in (2, 3):
        events = [json.loads(line) for line in (tmp_path / f"alerts{rank}.jsonl").read_text().splitlines()]
        lost = [(e["lost_replica"], e["world_epoch"], e["step"]) for e in events if "lost_replica" in e]
        assert lost == [(1, 1, 1), (0, 2, 2)], f"rank {rank} saw {lost}"
        assert all(e["in_step"] and e["module"] == "GPT" for e in events if "lost_replica" in e), events
        committed = [(e["committed"], e["world_epoch"]) for e in events if "committed" in e]
        assert committed == [(0, 0), (1, 1), (2, 2), (3, 2)], f"rank {rank} saw commits {committed}"
    # The dead ranks saw only what happened before they died.
    early = [json.loads(line) for line in (tmp_path / "alerts0.jsonl").read_text().splitlines()]
    assert [e.get("lost_replica") for e in early if "lost_replica" in e] == [1]


def test_adaptive_policy_departs_from_fault_free(tmp_path: Path, fault_free: dict[str, MPIJob]) -> None:
    job = launch(tmp_path, 4, ["--policy", "adaptive"], [{"step": 1, "rank": 2, "phase": "backward", "kind": "kill"}])
    ledger = read_ledger(job.outdir / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(STEPS))
    assert ledger[1]["committed"] == 6 and ledger[-1]["committed"] == 6
    ref = losses(fault_free["4x1"].outdir)
    assert ledger[0]["loss"] == pytest.approx(ref[0], rel=1e-6)
    deviation = max(abs(a["loss"] - b) / abs(b) for a, b in zip(ledger[1:], ref[1:]))
    assert deviation > 1e-3, f"AdaptiveWorld should change the trajectory; max relative deviation {deviation:.2e}"
    verdict = check_ledger(job.outdir / "ledger.jsonl", reference=str(fault_free["4x1"].outdir / "ledger.jsonl"))
    assert not verdict.ok


def test_hung_rank_is_detected_killed_and_removed(tmp_path: Path, fault_free: dict[str, MPIJob]) -> None:
    # 2x2: rank 2 SIGSTOPs in backward while its mate, rank 3, waits for it inside an FSDP2
    # collective on the MPI replica plane; the watchdog kills rank 2, rank 3 leaves by the gate.
    argv = [WORKER, "--steps", str(STEPS), "--shards", "2",
            "--faults", json.dumps([{"step": 1, "rank": 2, "phase": "backward", "kind": "hang"}])]
    job = run_mpi(4, argv, tmp_path, timeout=240, hang_timeout=4)
    ledger = check_recovered_run(job, fault_free["2x2"], expect_faults=1)
    assert "killing rank 2" in job.stderr, job.describe()
    assert ledger[1]["faults"] == [1]
    # Reported, not asserted against a clock: the survivors' wait in the reduce.
    print(f"hang detected after {ledger[1]['detect_s']:.2f}s (watchdog timeout 4 s)")


def test_rank_stuck_in_compute_is_killed_but_slow_work_between_steps_is_not(tmp_path: Path, fault_free: dict[str, MPIJob]) -> None:
    # Rank 2 spins forever inside a backward (alive, heart-beating); rank 0 sleeps 7 s between
    # steps 0 and 1, longer than the 4 s stuck timeout, which must not count.
    faults = [{"step": 1, "rank": 2, "phase": "backward", "kind": "stuck"}]
    argv = [WORKER, "--steps", str(STEPS), "--faults", json.dumps(faults), "--pause", "0:7"]
    job = run_mpi(4, argv, tmp_path, timeout=240, hang_timeout=4)
    ledger = check_recovered_run(job, fault_free["4x1"], expect_faults=1)
    assert "killing rank 2" in job.stderr and "stuck in compute" in job.stderr, job.describe()
    assert "killing rank 0" not in job.stderr, job.describe()
    assert ledger[1]["faults"] == [2]
    killed = re.search(r"killing rank 2 \(pid \d+\): no progress for ([\d.]+)s", job.stderr)
    assert killed is not None, job.describe()
    print(f"stuck rank killed after {killed.group(1)}s without progress (stuck timeout 4 s)")


def test_leader_killed_while_writing_a_checkpoint_has_it_finished_by_the_new_leader(tmp_path: Path) -> None:
    from reference import reference_run

    ckpt = tmp_path / "ckpt"
    common = ["--steps", "6", "--ckpt-dir", str(ckpt), "--ckpt-every", "2"]
    # Rank 0 (the leader replica) dies after writing its shard of the step-4 checkpoint, before
    # any rename; the new leader writes it again (no step committed since: the state is step 4's),
    # then, with min_replicas=4, the survivors stop (issue 34: no checkpoint cut off, no folder left).
    faults = [{"step": 4, "rank": 0, "phase": "checkpoint", "kind": "kill"}]
    first = run_mpi(4, [WORKER, *common, "--min-replicas", "4", "--faults", json.dumps(faults)], tmp_path, timeout=240)
    assert "kill rank 0 at step 4 checkpoint" in first.stderr and "fewer than min_replicas=4" in first.stderr, first.describe()
    assert "the leader replica 0 was lost while it saved" in first.stderr, first.describe()
    assert not list((ckpt / ".dcp").glob("*.tmp")), "the new leader removes the dead writer's leftover"
    assert resolve_ckpt_path("last", ckpt) == str(ckpt / "step-00000004.ckpt")
    whole = torch.load(ckpt / "last.ckpt", weights_only=False)
    assert whole["lightning_recover"]["step"] == 4
    # Resume from it on 3 replicas: same trajectory as a fault-free single process.
    second = run_mpi(3, [WORKER, *common, "--resume"], tmp_path, timeout=240)
    assert "resuming at step 4 on 3 replica(s)" in second.stderr, second.describe()
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(6))
    assert check_ledger(tmp_path / "ledger.jsonl").ok
    ref_losses, ref_params = reference_run(["--steps", "6"], 4)
    assert [line["loss"] for line in ledger] == pytest.approx(ref_losses, rel=1e-4)
    for p in survivor_params(second).values():
        assert_params_close(p, ref_params, rtol=1e-4, atol=1e-4)
    assert not list((ckpt / ".dcp").glob("*.tmp"))


def test_sharded_checkpoint_resumes_resharded_and_model_checkpoint_files_load_in_a_plain_process(tmp_path: Path) -> None:
    """2x2 writes (DCP, each shard rank its slice), 1x4 resumes (DCP reshards 2 -> 4) on the same trajectory;
    a user's ModelCheckpoint(monitor, save_top_k=2, save_last=True) keeps the right files, and its reported
    best/last paths load with Model.load_from_checkpoint in a plain Python process (no MPI)."""
    import subprocess
    import sys

    from reference import reference_run

    ckpt, best = tmp_path / "ckpt", tmp_path / "best"
    common = ["--steps", "6", "--ckpt-dir", str(ckpt), "--ckpt-every", "2"]
    faults = [{"step": 3, "rank": 3, "phase": "backward", "kind": "kill"}]
    first = run_mpi(4, [WORKER, "--shards", "2", *common, "--min-replicas", "2", "--faults", json.dumps(faults)], tmp_path, timeout=240)
    assert "fewer than min_replicas=2" in first.stderr, first.describe()
    assert resolve_ckpt_path("last", ckpt) == str(ckpt / "step-00000002.ckpt")
    (shards,) = [d for d in (ckpt / ".dcp").iterdir() if d.name.startswith("step-00000002.ckpt-")]
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], "each shard rank writes its slice"
    # Resume on one replica of 4 shard ranks, 1 sample each: the same 4-sample microbatches.
    resharded = ["--shards", "4", "--mbs", "1", *common, "--best-dir", str(best), "--resume"]
    second = run_mpi(4, [WORKER, *resharded], tmp_path, timeout=240)
    assert "resuming at step 2 on 1 replica(s)" in second.stderr, second.describe()
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(6))
    assert all(line["B"] == 4 and line["committed"] == 4 for line in ledger)
    ref_losses, ref_params = reference_run(["--shards", "2", *common], 2)
    assert [line["loss"] for line in ledger] == pytest.approx(ref_losses, rel=1e-4)
    finals = survivor_params(second)
    for p in finals.values():
        assert_params_close(p, ref_params, rtol=1e-4, atol=1e-4)
    # ModelCheckpoint's report, as rank 0 saw it: the two best files on disk, the best named by it.
    report = json.loads((tmp_path / "rank0.json").read_text())
    kept = report["best_k_models"]
    assert len(kept) == 2 and report["best_model_path"] == min(kept, key=kept.get), report
    assert sorted(p.name for p in best.glob("*.ckpt")) == sorted([*(Path(k).name for k in kept), "last.ckpt"])
    assert report["last_model_path"] == str(best / "last.ckpt")
    out = tmp_path / "loaded.pt"
    code = (
        "import sys, torch; from examples.model import GPT; "
        "load = lambda p: {k: v.clone() for k, v in GPT.load_from_checkpoint(p).state_dict().items()}; "
        f"torch.save({{'best': load({report['best_model_path']!r}), 'last': load({report['last_model_path']!r})}}, {str(out)!r}); "
        "import torch.distributed as d; assert not d.is_initialized() and 'mpi4py' not in sys.modules"
    )
    plain = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    loaded = torch.load(out)
    assert_params_close({k: v for k, v in loaded["last"].items() if k in ref_params}, finals[0], rtol=0, atol=0)
    best_step = int(Path(report["best_model_path"]).stem.split("-")[1])
    _, best_ref = reference_run(["--shards", "2", *common[2:], "--steps", str(best_step)], 2)
    assert_params_close({k: v for k, v in loaded["best"].items() if k in best_ref}, best_ref, rtol=1e-4, atol=1e-4)


def test_every_replica_dead_fails_the_job_with_a_clear_message(tmp_path: Path) -> None:
    faults = [{"step": 1, "rank": r, "phase": "forward", "kind": "kill"} for r in (0, 1)]
    job = run_mpi(2, [WORKER, "--steps", "3", "--faults", json.dumps(faults)], tmp_path, timeout=240)
    assert job.returncode != 0, job.describe()
    assert "every rank of the job failed: no replica survived" in job.stderr, job.describe()
    assert "ckpt_path=last" in job.stderr


def test_checkpoint_fallback_and_resume_on_fewer_replicas(tmp_path: Path) -> None:
    from reference import reference_run

    ckpt = tmp_path / "ckpt"
    common = ["--steps", "8", "--ckpt-dir", str(ckpt), "--ckpt-every", "2"]
    faults = [{"step": 3, "rank": 1, "phase": "backward", "kind": "kill"}, {"step": 5, "rank": 2, "phase": "backward", "kind": "kill"}]
    first = run_mpi(4, [WORKER, *common, "--min-replicas", "3", "--faults", json.dumps(faults)], tmp_path, timeout=240)
    # Below min_replicas the job stops with a clear message instead of limping on.
    assert "fewer than min_replicas=3" in first.stderr, first.describe()
    assert "every rank of the job failed" not in first.stderr, "a deliberate stop is not a total loss"
    assert resolve_ckpt_path("last", ckpt) == str(ckpt / "step-00000004.ckpt")
    assert not list((ckpt / ".dcp").glob("*.tmp")), "no half-written checkpoint may be left in place"
    # Relaunch on 2 replicas (the checkpoint had 3): B and the sample order come from the checkpoint.
    second = run_mpi(2, [WORKER, *common, "--resume"], tmp_path, timeout=240)
    assert "resuming at step 4 on 2 replica(s)" in second.stderr, second.describe()
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(8))
    assert all(line["B"] == 8 and line["committed"] == 8 for line in ledger)
    assert check_ledger(tmp_path / "ledger.jsonl").ok
    ref_losses, ref_params = reference_run(["--steps", "8"], 4)
    assert [line["loss"] for line in ledger] == pytest.approx(ref_losses, rel=1e-4)
    for p in survivor_params(second).values():
        assert_params_close(p, ref_params, rtol=1e-4, atol=1e-4)
