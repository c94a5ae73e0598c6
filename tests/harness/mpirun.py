"""Run real mpiexec jobs from pytest through the project's launcher, with a hard timeout.

Every job runs in its own process group; on timeout the whole group is SIGKILLed, so no
test can leave ranks behind or hang CI. Launched jobs import the package and the checkout's
``benchmarks/`` (the workers build the chaos campaign's tiny model) from this checkout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recover.cli.runner import RUNTIME_START_FAILURE

#: In a rank's crash report: the crash happened inside Open MPI's MPI_Init.
MPI_INIT_CRASH = "(ompi_mpi_init+"

if TYPE_CHECKING:
    from benchmarks.rigs.fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
WORKERS = Path(__file__).resolve().parents[1] / "workers"


@dataclass
class MPIJob:
    returncode: int
    stdout: str
    stderr: str
    outdir: Path

    def results(self) -> dict[int, dict]:
        """Per-rank JSON results keyed by original world rank."""
        out = {}
        for f in sorted(self.outdir.glob("rank*.json")):
            out[int(f.stem[4:])] = json.loads(f.read_text())
        return out

    def describe(self) -> str:
        return f"rc={self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


def _run_once(
    nprocs: int,
    args: list[str],
    outdir: Path,
    *,
    timeout: float = 120,
    hang_timeout: float | None = None,
    env: dict[str, str] | None = None,
    cluster: FakeCluster | None = None,
    map_by: str | None = None,
    during: Callable[[], None] | None = None,
    mpi_args: Sequence[str] = (),
    launcher_options: Sequence[str] = (),
) -> MPIJob:
    """One ``lightning-recover launch -n nprocs -- python ARGS`` with OUT=outdir; killed after ``timeout``.

    With ``cluster`` the launcher runs on the fake cluster's head host and places the ranks
    on all its hosts (``map_by``: Open MPI's ``--map-by``); ``during()`` then runs while the
    job does (host faults; without a cluster, e.g. killing standbys), and a timed-out job has every process of every host killed.
    ``mpi_args``: extra mpiexec arguments (the launcher's ``--mpi-arg``), e.g. Open MPI's
    heartbeat detector without its thread. ``launcher_options``: more ``lightning-recover launch``
    options (fake-cluster jobs only), e.g. ``--status-dir``."""
    outdir.mkdir(parents=True, exist_ok=True)
    if cluster is not None:
        cmd = cluster.launcher_argv(
            nprocs, [sys.executable, *args], hang_timeout=hang_timeout, map_by=map_by, extra=mpi_args, cwd=ROOT,
            launcher_options=launcher_options,
        )
    else:
        if map_by is not None or launcher_options:
            raise ValueError("map_by and launcher_options apply to fake-cluster jobs only; pass cluster=")
        cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(nprocs)]
        if hang_timeout is not None:
            cmd += ["--hang-timeout", str(hang_timeout)]
        cmd += [f"--mpi-arg={a}" for a in mpi_args]
        cmd += ["--", sys.executable, *args]
    full_env = dict(os.environ)
    pythonpath = os.pathsep.join([str(ROOT), str(BENCHMARKS)])
    full_env.update({"LR_TEST_OUT": str(outdir), "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath})
    full_env.update(env or {})
    # On fake hosts the launcher's output goes to files: a cut-off or frozen host's daemon
    # (started through the ssh stand-in, in a session of its own) outlives mpiexec and would
    # hold pipes open until teardown, though the launcher ended long before.
    sink = [open(outdir / f"launcher.{name}", "w+") for name in ("stdout", "stderr")] if cluster is not None else None
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=sink[0] if sink else subprocess.PIPE, stderr=sink[1] if sink else subprocess.PIPE,
        text=True, start_new_session=True,
    )

    def communicate(timeout: float) -> tuple[str, str]:
        if sink is None:
            return proc.communicate(timeout=timeout)
        proc.wait(timeout=timeout)
        return tuple(Path(f.name).read_text(errors="replace") for f in sink)  # type: ignore[return-value]

    # ``during`` runs beside the job, on a thread, while this one drains the job's pipes (a
    # full pipe would stall the ranks); if it fails, the job is ended and its error raised.
    failed: list[BaseException] = []

    def run_during() -> None:
        assert during is not None
        try:
            during()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread below
            failed.append(exc)
            _stop_job(proc, cluster)

    helper = threading.Thread(target=run_during, name="mpirun-during", daemon=True) if during is not None else None
    try:
        if helper is not None:
            helper.start()
        stdout, stderr = communicate(timeout)
    except subprocess.TimeoutExpired:
        _stop_job(proc, cluster)
        try:
            stdout, stderr = communicate(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = communicate(30)
        raise AssertionError(f"mpiexec job timed out after {timeout}s: {args}\n{stdout[-3000:]}\n{stderr[-5000:]}")
    finally:
        try:  # reap stragglers (e.g. SIGSTOPped ranks) that outlived mpiexec
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for f in sink or ():
            f.close()
    job = MPIJob(proc.returncode, stdout, stderr, outdir)
    if helper is not None:
        helper.join(timeout=120)
        if failed and not start_crashed(job):
            raise AssertionError(f"the fault injection beside the job failed: {failed[0]!r}\n{job.describe()}") from failed[0]
    return job


def _stop_job(proc: subprocess.Popen[str], cluster: FakeCluster | None) -> None:
    """End a launched job (it overran, or its fault injection failed) without reading its pipes."""
    # SIGTERM first: the launcher forwards it to mpiexec's own session and then SIGKILLs
    # that session; a SIGKILL here would orphan mpiexec's ranks, which hold our pipes.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if cluster is not None:
        # Ranks on the other fake hosts run in sessions of their own (as under sshd) and hold
        # our pipes too: give the launcher its chance, then end every process on every host.
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        cluster.kill_everything()


def start_crashed(job: MPIJob) -> bool:
    """Whether Open MPI failed before any rank trained: its runtime did not come up (a rare
    PMIx listener race, also seen in other projects' CI), or ranks crashed inside
    ``MPI_Init`` (seen on fake hosts under load: a failure notice handled before the world
    existed, a segfault in Open MPI's ``ompi_errhandler_proc_failed_internal``)."""
    crashed = RUNTIME_START_FAILURE in job.stderr or MPI_INIT_CRASH in job.stderr
    return job.returncode != 0 and crashed and not list(job.outdir.glob("rank*.json"))


def run_mpi(nprocs: int, args: list[str], outdir: Path, **options: Any) -> MPIJob:
    """``lightning-recover launch -n nprocs -- python ARGS`` (options: see ``_run_once``).

    A job in which Open MPI failed before any rank trained (:func:`start_crashed`) never
    tested anything of ours, so it is launched once more, and says so.
    """
    job = _run_once(nprocs, args, outdir, **options)
    if start_crashed(job):
        print(f"mpirun: Open MPI failed before any rank trained (rc={job.returncode}); launching once more", file=sys.stderr)
        job = _run_once(nprocs, args, outdir, **options)
    return job


def train_worker(
    nprocs: int, outdir: Path, argv: list[str], faults: list[dict], timeout: float = 240, data_plane: str | None = None,
    **options: Any,
) -> MPIJob:
    """``tests/workers/train_worker.py ARGV --faults FAULTS`` on ``nprocs`` ranks.

    ``data_plane`` sets recover.data_plane; None leaves train_worker's default, which is
    ``$RECOVER_TEST_DATA_PLANE`` (``RECOVER_TEST_DATA_PLANE=gloo python -m pytest ...`` runs
    every launched train_worker job over the gloo data plane), else mpi. ``options``: see ``_run_once``
    (``cluster``, ``map_by``, ``during``, ``hang_timeout``, ``env``)."""
    plane = ["--data-plane", data_plane] if data_plane is not None else []
    return run_mpi(
        nprocs, ["tests/workers/train_worker.py", *argv, *plane, "--faults", json.dumps(faults)], outdir, timeout=timeout, **options
    )


def joins_by_replica(records: list[dict]) -> dict[int, list[dict]]:
    """The ledger's join events per replica, each with the step whose line holds it."""
    out: dict[int, list[dict]] = {}
    for rec in records:
        for j in rec.get("joins", []):
            out.setdefault(j["replica"], []).append({**j, "step": rec["step"]})
    return out


def ledger_lines(job: MPIJob) -> list[dict]:
    """The job's ledger, every line with its full replicas and roles (the compact lines resolved)."""
    from lightning_recover.audit.ledger import read_ledger

    return read_ledger(job.outdir / "ledger.jsonl")


def assert_reference_run(job: MPIJob, argv: list[str], replicas: int) -> dict[int, dict]:
    """The ledger passes check-ledger against the one-process reference of train_worker ``argv`` (rtol 1e-4),
    and every rank that finished holds bitwise-identical parameters equal to the reference's; returns the results."""
    import torch
    from reference import reference_run

    from lightning_recover.audit.ledger_check import check_ledger

    ref_losses, ref_params = reference_run(argv, replicas)
    ref = job.outdir / "reference.jsonl"
    ref.write_text("".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(ref_losses)))
    verdict = check_ledger(job.outdir / "ledger.jsonl", reference=str(ref), rtol=1e-4)
    assert verdict.ok, verdict.problems
    results = job.results()
    params = {r: torch.load(job.outdir / f"params{r}.pt") for r in results if (job.outdir / f"params{r}.pt").exists()}
    first = next(iter(params.values()))
    for r, p in params.items():
        assert all(torch.equal(first[k], p[k]) for k in first), f"rank {r} differs from rank {next(iter(params))}"
    for k, v in ref_params.items():
        torch.testing.assert_close(first[k], v, rtol=1e-4, atol=1e-4)
    return results
