"""``lightning-recover launch --supervise`` on this host: relaunch after a whole-job loss, the stall
watchdog, give-up verdicts; and the continued ledger of examples/pretrain.py against the fault-free run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "pretrain.py")
WORKER = str(ROOT / "tests" / "workers" / "supervised_worker.py")
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in [k for k in env if k.startswith(("OMPI_", "PMIX_", "LIGHTNING_RECOVER_"))]:
        del env[key]
    return env


def _supervise(args: list[str], command: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", *args, "--", sys.executable, *command]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _reference(steps: list[str], grad_accum: int, run_dir: Path) -> subprocess.Popen[str]:
    """The fault-free single-process run with B = ``grad_accum``: the ledger a fault-tolerant run must equal."""
    return subprocess.Popen(
        [sys.executable, SCRIPT, *steps, f"recover.grad_accum={grad_accum}", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher forwards it to mpiexec's session, then ends it
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"timed out after {timeout} s\n{out[-3000:]}\n{err[-5000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out, err


def _lines(stderr: str, needle: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[lightning-recover] supervise:") and needle in line]


# ------------------------------------------------------------------------------ the loop, on a torch-free job
@pytest.mark.mpi
def test_stall_watchdog_ends_a_hung_job_and_the_relaunch_resumes(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step-00000003.ckpt").write_text("")
    (ck / "last.ckpt").symlink_to("step-00000003.ckpt")
    ledger = tmp_path / "ledger.jsonl"
    rc, out, err = _finish(
        _supervise(["-n", "1", "--supervise", "--checkpoint-dir", str(ck), "--ledger", str(ledger), "--stall-timeout", "3",
                    "--relaunch-backoff", "0.1", "--status-dir", str(tmp_path / "shared")], [WORKER, "stall", str(ledger)]),
        timeout=60,
    )
    detail = f"rc={rc}\n{err[-4000:]}"
    assert rc == 0, detail
    assert [r["step"] for r in read_ledger(ledger)] == [0, 1, 2, 3, 4, 5], detail
    (stall,) = _lines(err, "stall watchdog: no committed step for")
    (relaunch,) = _lines(err, "relaunch 1/3")
    assert "no progress within the stall timeout" in relaunch and "step-00000003.ckpt" in relaunch and "2 step(s) to replay" in relaunch
    assert _lines(err, "attempt 2: ")[0].endswith("++ckpt_path=last"), detail
    assert _lines(err, "the job finished after 1 relaunch(es)"), detail
    (cost,) = _lines(err, "relaunch 1 cost")
    assert "replay 1.0 s (2 step(s) since the checkpoint)" in cost, cost
    # The markers went to --status-dir (the worker's ok marker there is what made attempt 2 "done"), kept, one
    # directory per attempt, as the plain launcher keeps its own.
    (kept,) = (tmp_path / "shared").iterdir()
    assert sorted(d.name for d in kept.iterdir()) == ["attempt-0", "attempt-1"], detail
    assert "ok.0" in os.listdir(kept / "attempt-1") and "ok.0" not in os.listdir(kept / "attempt-0"), detail


@pytest.mark.mpi
def test_relaunches_are_bounded_and_program_errors_are_not_relaunched(tmp_path: Path) -> None:
    common = ["-n", "1", "--supervise", "--checkpoint-dir", str(tmp_path), "--relaunch-backoff", "0.1"]
    die = _supervise([*common, "--max-relaunches", "2"], [WORKER, "die", str(tmp_path / "l")])
    raised = _supervise(common, [WORKER, "raise", str(tmp_path / "l")])
    rc, _, err = _finish(die, timeout=60)
    assert rc != 0 and len(_lines(err, "attempt ")) == 6, err[-4000:]  # 3 attempts: a command line and a verdict each
    assert _lines(err, "relaunch 2/2") and not _lines(err, "relaunch 3/")
    (verdict,) = _lines(err, "giving up")
    assert "every replica died" in verdict and "all 2 relaunch(es) are spent" in verdict and "--max-relaunches" in verdict
    assert "from the start (no checkpoint yet)" in _lines(err, "relaunch 1/2")[0]
    assert "give --ledger to measure the time lost" in _lines(err, "relaunch 1/2")[0] and not _lines(err, "cost")
    rc, _, err = _finish(raised, timeout=60)
    assert rc != 0 and not _lines(err, "relaunch 1/"), err[-4000:]
    (verdict,) = _lines(err, "giving up")
    assert "ValueError: bad lr" in verdict and "fix the error" in verdict


@pytest.mark.mpi
def test_sigterm_to_the_supervisor_ends_the_job_without_a_relaunch(tmp_path: Path) -> None:
    # A cancelled (or timed-out) Slurm job gets SIGTERM: that ends the job, it is no failure to repair.
    ledger = tmp_path / "ledger.jsonl"
    job = _supervise(["-n", "1", "--supervise", "--checkpoint-dir", str(tmp_path), "--relaunch-backoff", "0.1"],
                     [WORKER, "stall", str(ledger)])
    deadline = time.monotonic() + 30
    while _committed(ledger) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    rc, _, err = _finish(job, timeout=30)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert _lines(err, "the job was ended by SIGTERM; not relaunching") and not _lines(err, "relaunch 1/"), err[-3000:]


@pytest.mark.mpi
def test_a_host_whose_daemon_never_came_up_is_dropped_and_the_job_runs_on_the_rest(tmp_path: Path) -> None:
    # 'ghost' does not resolve: PRRTE's daemon there never reports back and prterun names the
    # host. The relaunch leaves it out and fits whole replicas into the remaining slot.
    rc, _, err = _finish(
        _supervise(["-n", "2", "--supervise", "--hosts", "localhost:1,ghost:1", "--checkpoint-dir", str(tmp_path),
                    "--relaunch-backoff", "0.1"], [WORKER, "finish", str(tmp_path / "l")]),
        timeout=60,
    )
    detail = f"rc={rc}\n{err[-4000:]}"
    assert rc == 0, detail
    (relaunch,) = _lines(err, "relaunch 1/3")
    assert "did not start on every host; lost host(s): ghost" in relaunch and "1 rank(s) on localhost:1" in relaunch, detail
    second = _lines(err, "attempt 2: ")[0]
    assert "--host localhost:1 " in second and " -n 1 " in second, detail
    assert _lines(err, "the job finished after 1 relaunch(es)"), detail


# ------------------------------------------------------------------------------ pretrain: the whole job lost
def _rank_pids(run_dir: Path) -> list[int]:
    """The job's ranks: processes running examples/pretrain.py into ``run_dir`` (not mpiexec, not the supervisor)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1] == SCRIPT.encode() and f"hydra.run.dir={run_dir}".encode() in argv:
            pids.append(int(entry))
    return pids


def _committed(ledger: Path) -> int:
    try:
        return len(ledger.read_text().splitlines())
    except OSError:
        return 0


@pytest.mark.mpi
def test_every_rank_killed_mid_run_is_relaunched_from_the_checkpoint_and_the_ledger_is_exact(tmp_path: Path) -> None:
    # 2 replicas x grad_accum 2 (B = 4), a checkpoint every 5 steps. At step >= 12 every rank
    # is stopped, then killed: no replica is left to continue in place (the whole-job abort
    # PRRTE does on a lost daemon). The supervisor relaunches with ++ckpt_path=last; the
    # ledger must equal the fault-free single-process run with B = 4 (grad_accum 4).
    steps = ["model=tiny", "trainer.max_steps=30", "seed=3", "data.max_bytes=40000", *QUIET]
    ref_dir = tmp_path / "ref"
    reference = _reference(steps, 4, ref_dir)
    run = tmp_path / "run"
    ledger = run / "ledger.jsonl"
    job = _supervise(
        ["-n", "2", "--supervise", "--checkpoint-dir", str(run / "checkpoints"), "--ledger", str(ledger), "--max-relaunches", "2",
         "--relaunch-backoff", "0.1"],
        [SCRIPT, *steps, "recover.grad_accum=2", "recover.checkpoint.every_n_steps=5", "recover.checkpoint.async_save=false",
         f"hydra.run.dir={run}"],
    )
    deadline = time.monotonic() + 150
    while _committed(ledger) < 13 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = _rank_pids(run)
    assert len(pids) == 2 and job.poll() is None, f"ranks {pids} at ledger line {_committed(ledger)}"
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first, so that no rank sees the other die and goes on alone
        for pid in pids:
            os.kill(pid, sig)
    killed_at = _committed(ledger)
    rc, out, err = _finish(job, timeout=200)
    ref_rc, _, ref_err = _finish(reference, timeout=60)
    detail = f"rc={rc}\n--- stdout ---\n{out[-2000:]}\n--- stderr ---\n{err[-6000:]}"
    assert ref_rc == 0, ref_err[-3000:]
    assert rc == 0, detail
    (relaunch,) = _lines(err, "relaunch 1/2")
    # The newest checkpoint at the kill: step 5 * floor(killed_at / 5), or the one before if its write was under way.
    resumed = [int(line.split("resuming at step ")[1].split()[0]) for line in err.splitlines() if "] resuming at step " in line]
    assert len(resumed) == 1 and resumed[0] in (5 * (killed_at // 5), 5 * (killed_at // 5) - 5) and resumed[0] >= 10, detail
    assert "[lightning-recover] resuming at step {} on 2 replica(s)".format(resumed[0]) in err, detail
    assert "every replica died" in relaunch and "2 rank(s) on localhost" in relaunch, detail
    assert f"step-{resumed[0]:08d}.ckpt" in relaunch and f"{killed_at - resumed[0]} step(s) to replay" in relaunch, detail
    assert _lines(err, "attempt 2: ")[0].endswith("++ckpt_path=last"), detail
    assert _lines(err, "the job finished after 1 relaunch(es)"), detail
    (cost,) = _lines(err, "relaunch 1 cost")
    assert "restore -" not in cost, cost
    print(cost)  # the measured cost of a relaunch (pytest -s shows it)
    records = read_ledger(ledger)
    assert [r["step"] for r in records] == list(range(30)) and all(r["B"] == 4 for r in records), detail
    verdict = check_ledger(ledger, reference=str(ref_dir / "ledger.jsonl"), rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{detail}"
    assert any(line.startswith("pretrain.py: done: 30 steps") for line in out.splitlines()), detail


@pytest.mark.mpi
def test_a_rank_sent_sigterm_is_a_lost_replica_never_a_finished_one(tmp_path: Path) -> None:
    # mpiexec aborting a job, or a scheduler draining a node, sends SIGTERM. Lightning turns it into
    # a clean SystemExit (status 0) during fit: the rank must still read as killed -- no ok marker,
    # status 143 -- and the others go on without it, exactly as after a SIGKILL.
    steps = ["model=tiny", "trainer.max_steps=20", "seed=3", "data.max_bytes=40000", *QUIET]
    ref_dir = tmp_path / "ref"
    reference = _reference(steps, 3, ref_dir)
    run, status = tmp_path / "run", tmp_path / "status"
    ledger = run / "ledger.jsonl"
    job = _supervise(["-n", "3", "--status-dir", str(status)], [SCRIPT, *steps, "recover.grad_accum=1", f"hydra.run.dir={run}"])
    deadline = time.monotonic() + 150
    while _committed(ledger) < 5 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    ranks = {int(_environ(pid).get("OMPI_COMM_WORLD_RANK", "-1")): pid for pid in _rank_pids(run)}
    assert sorted(ranks) == [0, 1, 2] and job.poll() is None, f"ranks {ranks} at ledger line {_committed(ledger)}"
    os.kill(ranks[2], signal.SIGTERM)
    rc, out, err = _finish(job, timeout=200)
    ref_rc, _, ref_err = _finish(reference, timeout=60)
    detail = f"rc={rc}\n--- stdout ---\n{out[-2000:]}\n--- stderr ---\n{err[-6000:]}"
    assert ref_rc == 0, ref_err[-3000:]
    assert rc == 0, detail
    markers = sorted(n for d in status.iterdir() for n in os.listdir(d))
    assert "started.2" in markers and not {"ok.2", "exited.2", "raised.2"} & set(markers), f"{markers}\n{detail}"
    assert {"ok.0", "ok.1"} <= set(markers), f"{markers}\n{detail}"
    records = read_ledger(ledger)
    assert [r["step"] for r in records] == list(range(20)) and all(r["B"] == 3 for r in records), detail
    assert [r["step"] for r in records if 2 in r["faults"]] and records[-1]["replicas"] == [0, 1], detail
    verdict = check_ledger(ledger, reference=str(ref_dir / "ledger.jsonl"), rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{detail}"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if b"=" in item)
