"""Slurm across nodes, on fake hosts: ``sbatch -N 3`` of examples/slurm/train.sbatch, one node lost, the allocation lost.

One ``slurmd`` per fake host, ``slurmctld`` on the bridge (tests/harness/slurm_hosts.py). The
example runs ``lightning-recover launch --supervise`` in the batch script on the first node;
Open MPI's runtime starts its daemon on the other nodes through ``srun`` (its Slurm launcher),
so every rank runs on its node under that node's ``slurmd``.

- A node lost whole (its slurmd, Open MPI's daemon there and its rank), the job submitted with
  ``--no-kill``: Open MPI 5.0's runtime aborts the MPI job when a daemon is lost, so the
  supervisor relaunches it from the newest checkpoint inside the same allocation on the two
  nodes left; the ledger matches the fault-free run and the job ends COMPLETED 0:0.
- The batch node lost (the whole allocation: mpiexec and the supervisor were on it), the job
  submitted with ``--requeue``: Slurm requeues it, the requeued batch script finds the
  checkpoint and resumes; the ledger matches the fault-free run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger
from benchmarks.rigs.fake_cluster import FakeCluster
from harness.mpirun import BENCHMARKS, ROOT
from harness.slurm_hosts import SlurmOnHosts

pytestmark = pytest.mark.mpi

SBATCH = "examples/slurm/train.sbatch"
PRETRAIN = "examples/pretrain.py"
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
STEPS = 6
#: The tiny GPT, B = 6 (3 replicas x 2 microbatches); the reference runs it as one process.
RUN = ["model=tiny", f"trainer.max_steps={STEPS}", "seed=3", "data.max_bytes=40000", *QUIET]
#: A checkpoint every 2 steps, written before the step returns (the fault comes right after one).
CKPT = ["recover.checkpoint.async_save=false"]


@pytest.fixture
def slurm_hosts(fake_cluster: Callable[..., FakeCluster]) -> Iterator[SlurmOnHosts]:
    """4 fake hosts, each a Slurm node (1 CPU) with its own slurmd; the controller on the bridge. Always stopped."""
    with SlurmOnHosts(fake_cluster(4)) as slurm:
        yield slurm


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free ledger of the same steps: one process, B = 6 (grad_accum 6)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    done = subprocess.run(
        [sys.executable, PRETRAIN, *RUN, "recover.grad_accum=6", f"hydra.run.dir={run}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return run / "ledger.jsonl"


def job_env(run: Path) -> dict[str, str]:
    """The submitting shell: this venv first on PATH, the checkout importable, the run directory.

    ``PRTE_MCA_hwloc_default_binding_policy=none``: the fake hosts share this machine's cores,
    so Open MPI's per-node binding would put every node's rank on the same core (a real node
    has its own cores; leave it out there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLURM_", "LIGHTNING_RECOVER_"))}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", ""), "/usr/sbin"])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(BENCHMARKS)])
    env["OMP_NUM_THREADS"] = "1"
    env["RUN_DIR"] = str(run)
    env["CKPT_EVERY"] = "2"
    env["PRTE_MCA_hwloc_default_binding_policy"] = "none"
    return env


def ledger_steps(run: Path) -> int:
    try:
        return len(read_ledger(run / "ledger.jsonl"))
    except (OSError, ValueError):
        return 0


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, slurm: SlurmOnHosts, job_id: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        fields = slurm.job_state(job_id)
        if fields.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job_id} ended ({fields.get('JobState')}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}; job {fields.get('JobState')}")
        time.sleep(0.2)


def test_a_node_lost_under_no_kill_is_relaunched_in_the_allocation_and_completes_exactly(
    slurm_hosts: SlurmOnHosts, reference: Path, tmp_path: Path
) -> None:
    slurm, cluster = slurm_hosts, slurm_hosts.cluster
    run, out = tmp_path / "run", tmp_path / "job.out"
    t0 = time.monotonic()
    job_id = slurm.submit(["-N", "3", "-n", "3", f"--output={out}", SBATCH, *RUN, *CKPT, "recover.grad_accum=2"],
                          job_env(run), ROOT)
    wait_for(lambda: ledger_steps(run) >= 3, 240, "step 2 (and its checkpoint) in the ledger", slurm, job_id)
    nodes = slurm.job_state(job_id)["NodeList"]
    lost = cluster.hosts[2]
    killed_at = time.monotonic()
    cluster.kill_host(lost)  # its slurmd, slurmstepd, Open MPI's daemon and its rank
    fields = slurm.wait_job(job_id, 200)
    took, total = time.monotonic() - killed_at, time.monotonic() - t0
    text = out.read_text()
    detail = f"{fields}\n{text[-6000:]}\n{slurm.logs()[-3000:]}"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), detail
    # Both attempts asked Open MPI's srun for its daemons to share the job's CPUs (else the relaunch waits behind the lost step).
    assert text.count("--prtemca plm_slurm_args --overlap") == 2, detail
    relaunch = [line for line in text.splitlines() if "supervise:" in line and "relaunch 1/" in line]
    assert len(relaunch) == 1 and f"lost host(s): {lost.name}" in relaunch[0], detail
    left = ",".join(f"{h.name}:1" for h in cluster.hosts[:2])
    assert f"2 rank(s) on {left}" in relaunch[0], detail
    records = read_ledger(run / "ledger.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS)) and all(r["B"] == 6 for r in records), detail
    assert records[0]["replicas"] == [0, 1, 2] and records[-1]["replicas"] == [0, 1], records
    verdict = check_ledger(run / "ledger.jsonl", reference=str(reference), rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{detail}"
    print(f"nodes {nodes}: {lost.name} lost; job COMPLETED {took:.1f} s later; submit to end {total:.1f} s")


def test_the_allocation_lost_under_requeue_resumes_from_the_newest_checkpoint_exactly(
    slurm_hosts: SlurmOnHosts, reference: Path, tmp_path: Path
) -> None:
    # The three nodes of the allocation are lost whole (the batch script, the supervisor, mpiexec,
    # every daemon and rank). Slurm requeues the job (sbatch --requeue, in the example); two of the
    # nodes come back (rebooted: a fresh host, its slurmd started again) and the job starts again on
    # them and the spare node; the batch script finds the checkpoint in its RUN_DIR and resumes.
    slurm, cluster = slurm_hosts, slurm_hosts.cluster
    run, out = tmp_path / "run", tmp_path / "job.out"
    t0 = time.monotonic()
    job_id = slurm.submit(["-N", "3", "-n", "3", f"--output={out}", SBATCH, *RUN, *CKPT, "recover.grad_accum=2"],
                          job_env(run), ROOT)
    wait_for(lambda: ledger_steps(run) >= 3, 240, "step 2 (and its checkpoint) in the ledger", slurm, job_id)
    first = slurm.job_state(job_id)
    killed_at = time.monotonic()
    for host in (0, 1, 2):
        cluster.kill_host(host)
    deadline = time.monotonic() + 120
    while (state := slurm.job_state(job_id)).get("Restarts", "0") == "0":
        assert time.monotonic() < deadline, f"not requeued 120 s after its nodes were lost: {state}\n{slurm.logs()}"
        time.sleep(0.5)
    requeued_after = time.monotonic() - killed_at
    for host in (1, 2):  # rebooted
        cluster.revive(host)
        slurm.start_slurmd(host)
    fields = slurm.wait_job(job_id, 240, restarts=1)
    took, total = time.monotonic() - killed_at, time.monotonic() - t0
    text = out.read_text(errors="replace")
    detail = f"{fields}\n{text[-6000:]}\n{slurm.logs()[-3000:]}"
    assert first["NodeList"] == f"{cluster.hosts[0].name[:-1]}[0-2]" and first["Restarts"] == "0", first
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), detail
    assert fields["NodeList"] == f"{cluster.hosts[0].name[:-1]}[1-3]", detail
    resumed = [line for line in text.splitlines() if "resuming at step" in line]
    assert len(resumed) == 1 and "on 3 replica(s)" in resumed[0], detail
    records = read_ledger(run / "ledger.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS)) and all(r["B"] == 6 for r in records), detail
    verdict = check_ledger(run / "ledger.jsonl", reference=str(reference), rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{detail}"
    print(f"nodes {first['NodeList']} lost; requeued {requeued_after:.1f} s later, ran again on {fields['NodeList']}: "
          f"{resumed[0].split('] ', 1)[-1]}; COMPLETED {took:.1f} s after the loss; submit to end {total:.1f} s")
