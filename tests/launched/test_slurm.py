"""Slurm as users run it, on a real local Slurm (tests/harness/slurm_cluster.py, the ``slurm`` fixture).

- the supported way: ``sbatch examples/slurm/train.sbatch`` runs ``lightning-recover launch``
  inside the allocation (no ``-n``: the allocation's 4 tasks), a rank is SIGKILLed mid-step,
  the job ends ``COMPLETED 0:0`` and its ledger matches the fault-free reference;
- inside an allocation every rank has the right ``global_rank``/``world_size`` although all of
  them inherit ``SLURM_PROCID=0`` (Lightning's SLURMEnvironment is never chosen);
- a direct ``srun -n 2`` start is refused on every task with one line, exit status 2, nothing
  written;
- the environment rules behind these (which start is Slurm's, which allocation needs unbound ranks).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger
from lightning_recover.cli.launcher import build_command
from lightning_recover.runtime.slurm import allocation_tasks, refusal_line, started_by_srun, tasks_outnumber_cpus
from harness.mpirun import BENCHMARKS, ROOT
from harness.slurm_cluster import LocalSlurm

SBATCH = "examples/slurm/train.sbatch"
PRETRAIN = "examples/pretrain.py"
USER_SCRIPT = "tests/workers/user_script.py"
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
#: 3 steps of the tiny GPT with B = 8 (the sbatch run: 4 replicas x 2 microbatches).
RUN = ["model=tiny", "trainer.max_steps=3", "seed=3", *QUIET]
REFUSAL = re.compile(r"^(\d+): \[lightning-recover\] error: task (\d+) of 2 was started by srun, not by mpiexec: .*lightning-recover launch")


def job_env(slurm: LocalSlurm, **extra: str) -> dict[str, str]:
    """What a user's shell holds when submitting: this venv's python/lightning-recover first on PATH,
    this checkout importable (sbatch/srun pass the environment on to the job), the local cluster."""
    env = slurm.env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(BENCHMARKS)])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def sbatch(slurm: LocalSlurm, args: list[str], env: dict[str, str], timeout_s: float) -> tuple[dict[str, str], float]:
    """Submit, wait for the end; the job's final fields and the wall time from submission to its end."""
    t0 = time.monotonic()
    out = subprocess.run(["sbatch", "--parsable", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    fields = slurm.wait_job(job_id, timeout_s)
    return fields, time.monotonic() - t0


# ---------------------------------------------------------------------- environment rules
BATCH = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_CPUS_PER_NODE": "1"}
STEP = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        (STEP, True),  # srun -n 2 python train.py: what Slurm gives each task
        ({**STEP, "PMIX_RANK": "1"}, True),  # srun --mpi=pmix sets PMIx variables, still not mpiexec
        (BATCH, False),  # the batch script itself (and plain python in it)
        ({**BATCH, "OMPI_COMM_WORLD_RANK": "3", "PRTE_LAUNCHED": "1"}, False),  # an mpiexec rank inside sbatch
        ({**STEP, "OMPI_COMM_WORLD_RANK": "3", "PRTE_LAUNCHED": "1"}, False),  # under a prted that srun started (multi-node)
        ({**STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}, False),  # srun --pty bash: one process
        ({}, False),  # no Slurm at all
    ],
)
def test_which_starts_are_refused(env: dict[str, str], refused: bool) -> None:
    assert started_by_srun(env) is refused


def test_refusal_is_one_line_naming_the_fix() -> None:
    line = refusal_line(STEP, "pretrain.py")
    assert "\n" not in line
    for needle in ("task 1 of 2", "srun", "sbatch/salloc", "lightning-recover launch -- python pretrain.py"):
        assert needle in line, needle


def test_allocation_tasks_and_binding() -> None:
    assert allocation_tasks(BATCH) == 4 and allocation_tasks({}) is None
    with pytest.raises(ValueError, match="SLURM_NTASKS='x'.*-n N"):
        allocation_tasks({**BATCH, "SLURM_NTASKS": "x"})
    assert tasks_outnumber_cpus(BATCH)  # sbatch -n 4 -O on a node: 4 tasks, 1 CPU
    assert not tasks_outnumber_cpus({**BATCH, "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_CPUS_PER_NODE": "4(x2)"})
    assert tasks_outnumber_cpus({**BATCH, "SLURM_TASKS_PER_NODE": "2,8", "SLURM_JOB_CPUS_PER_NODE": "4(x2)"})
    argv = build_command(4, ["python", "t.py"], mpiexec="mpiexec", hosts="localhost:4", slots=4, unbound=True)
    assert argv[argv.index("--bind-to") + 1] == "none" and "--oversubscribe" not in argv
    assert "--bind-to" not in build_command(4, ["python", "t.py"], mpiexec="mpiexec", hosts="localhost:4", slots=4)


def test_inside_an_allocation_daemons_overlap_and_nodes_are_probed_through_srun(tmp_path: Path) -> None:
    from lightning_recover.cli.hosts import SRUN_PROBE, remote_agent
    from lightning_recover.runtime.slurm import daemon_step_args

    # Open MPI's daemon step shares the job's CPUs, so a relaunch never waits behind a step that lost a node.
    assert daemon_step_args([], BATCH) == ["--prtemca", "plm_slurm_args", "--overlap"]
    assert daemon_step_args([], {}) == []
    assert daemon_step_args(["--prtemca", "plm_slurm_args", "--exact"], BATCH) == []  # the user's own srun options win
    assert daemon_step_args([], {**BATCH, "PRTE_MCA_plm_slurm_args": "--exact"}) == []
    # The supervisor probes a node the way Open MPI reaches it there (srun), not by ssh.
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    inside = {**BATCH, "PATH": str(tmp_path)}
    assert remote_agent([], inside) == list(SRUN_PROBE) and SRUN_PROBE[-1] == "--nodelist" and "--overlap" in SRUN_PROBE
    assert remote_agent(["--prtemca", "plm", "ssh"], inside)[0] == "ssh"  # the user chose Open MPI's ssh launcher
    assert remote_agent(["--prtemca", "plm_ssh_agent", "/h/agent -q"], inside) == ["/h/agent", "-q"]
    assert remote_agent([], {"PATH": str(tmp_path)})[0] == "ssh"  # outside an allocation
    assert remote_agent([], {**BATCH, "PATH": str(tmp_path / "none")})[0] == "ssh"  # no srun found


# ---------------------------------------------------------------------- on the local Slurm
@pytest.mark.mpi
def test_direct_srun_is_refused_on_every_task(slurm: LocalSlurm, tmp_path: Path) -> None:
    # The example (refused before Hydra makes its run directory) and a user's own Lightning
    # script (refused by the strategy, before MPI starts).
    for script, args in ((PRETRAIN, [*RUN, f"hydra.run.dir={tmp_path / 'run'}"]), (USER_SCRIPT, [])):
        t0 = time.monotonic()
        done = subprocess.run(
            ["srun", "-n", "2", "-l", sys.executable, script, *args],
            cwd=ROOT, env=job_env(slurm), capture_output=True, text=True, timeout=120,
        )
        took = time.monotonic() - t0
        assert done.returncode == 2, f"{script}: rc={done.returncode}\n{done.stdout}\n{done.stderr}"
        # srun -l labels each task's lines "N: "; srun's own reports (the exit codes) are not the tasks'.
        lines = [line for line in done.stderr.splitlines() if re.match(r"\d+: ", line)]
        tasks = sorted((m.group(1), m.group(2)) for m in map(REFUSAL.match, lines) if m is not None)
        assert tasks == [("0", "0"), ("1", "1")] and len(lines) == 2, f"{script}:\n{done.stderr}"
        assert Path(script).name in lines[0]
        assert "Traceback" not in done.stderr and not done.stdout.strip(), done.stdout
        print(f"{script}: refused in {took:.1f} s")
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
def test_ranks_inside_an_allocation_are_mpi_ranks_not_slurm_ranks(slurm: LocalSlurm, tmp_path: Path) -> None:
    # 4 ranks on a 1-CPU allocation (-O); no -n: the launcher takes the allocation's 4 tasks.
    out = tmp_path / "job.out"
    fields, took = sbatch(
        slurm, ["-n", "4", "-O", f"--output={out}", "--wrap", f"lightning-recover launch -- python {USER_SCRIPT} --report-ranks"],
        job_env(slurm), timeout_s=150,
    )
    text = out.read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "--bind-to none" in text and "--host localhost:4" in text, text
    seen = dict(re.findall(r"user_script: rank (\d) ranks: (.*)", text))
    assert sorted(seen) == ["0", "1", "2", "3"], text
    for rank, line in seen.items():
        assert f"global_rank={rank} world_size=4 " in line, line
        assert "cluster_environment=ReplicaEnvironment" in line and "node_rank=0" in line, line
        # What makes the test mean something: Slurm's variables are there, and Lightning's own
        # SLURMEnvironment would read every rank as rank 0.
        assert "slurm_detect=True SLURM_PROCID=0 SLURM_NTASKS=4" in line, line
    print(f"4 ranks inside an allocation: submit to end {took:.1f} s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free ledger of the same 3 steps: one process, B = 8 (grad_accum 8)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    done = subprocess.run(
        [sys.executable, PRETRAIN, *RUN, "recover.grad_accum=8", f"hydra.run.dir={run}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return run / "ledger.jsonl"


@pytest.mark.mpi
def test_sbatch_example_survives_a_kill_and_matches_the_reference(slurm: LocalSlurm, reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = tmp_path / "job.out"
    fields, took = sbatch(
        slurm,
        ["-n", "4", "-O", f"--output={out}", SBATCH, *RUN, "recover.grad_accum=2",
         "fault.schedule=[{step:1,rank:2,phase:backward,kind:kill}]"],
        job_env(slurm, RUN_DIR=str(run)), timeout_s=150,
    )
    text = out.read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "mpiexec --with-ft ulfm" in text and " -n 4 " in text and "--bind-to none" in text, text
    ledger = read_ledger(run / "ledger.jsonl")
    assert [line["step"] for line in ledger] == [0, 1, 2], text
    assert ledger[0]["replicas"] == [0, 1, 2, 3] and ledger[1]["faults"] == [2], ledger
    assert all(line["B"] == 8 for line in ledger)
    verdict = check_ledger(run / "ledger.jsonl", reference=str(reference), rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{text}"
    assert "relaunch 1/" not in text, text  # repaired in place, not by the supervisor
    print(f"sbatch example with a kill: submit to end {took:.1f} s")


def test_no_slurm_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness import slurm_cluster

    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name: None)
    monkeypatch.setattr(slurm_cluster.os.path, "exists", lambda path: False)
    with pytest.raises(RuntimeError, match=r"slurmctld, slurmd, sbatch.*apt-get install -y slurmctld slurmd slurm-client"):
        LocalSlurm()
    # Missing binaries are named first, whoever runs: installing them is the first fix.
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="Slurm binaries not found"):
        LocalSlurm()
    monkeypatch.undo()
    # Binaries present (as in CI, or as if installed here), user not root: the root message.
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="needs root.*uid is 1000"):
        LocalSlurm()
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    assert slurm_cluster.missing_requirements() is None
