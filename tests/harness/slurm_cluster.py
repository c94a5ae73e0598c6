"""A real one-node Slurm cluster (Debian's slurmctld + slurmd) for the tests that need Slurm.

:class:`LocalSlurm` writes a ``slurm.conf`` into a temporary directory (no authentication
daemon, Linux process tracking, no task plugin, CPUs as the consumable resource, a partition
that lets 4 tasks share a CPU), starts both daemons in the foreground (``-D``) in their own
process groups, waits until ``sinfo`` shows the node idle, and always stops them by pid
(their whole process group) and removes the directory: on a normal end, on a failing test
and on a timeout. The client commands (``sbatch``, ``srun``, ``scontrol``, ``sinfo``) find
the cluster through ``SLURM_CONF``, which :meth:`LocalSlurm.env` sets.

Missing binaries or a non-root user are errors that name the fix, never a skip: a test that
needs Slurm and has none must fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The Debian packages that provide the daemons and the client commands.
PACKAGES = "slurmctld slurmd slurm-client"
_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


def _free_port() -> int:
    # Another engineer's Slurm (or a previous session's) may hold the default ports 6817/6818.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_requirements() -> str | None:
    """Why a local Slurm cannot start here (with the fix), or None."""
    missing = [b for b in _BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"Slurm binaries not found: {', '.join(missing)}; install them: apt-get install -y {PACKAGES} (bash .ci/run does)"
    if os.geteuid() != 0:
        return f"the local Slurm needs root (slurmd starts jobs as their user; uid is {os.geteuid()}); run the tests as root"
    return None


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM it when the test process dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG), so a killed pytest never leaves a Slurm running."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def _terminated(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}: stopping the local Slurm")


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    """One controller and one node (``localhost``, all of this machine's CPUs) under a temporary directory."""

    def __init__(self, start_timeout_s: float = 60.0) -> None:
        why = missing_requirements()
        if why is not None:
            raise RuntimeError(why)
        self.start_timeout_s = start_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="lr-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.cpus = os.cpu_count() or 1
        self._procs: list[subprocess.Popen[bytes]] = []
        self._previous_term: Any = signal.SIG_DFL

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the client commands pointed at this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir()
        host = socket.gethostname()
        d = self.dir
        self.conf.write_text(
            "\n".join([
                "ClusterName=lrtest",
                # slurmctld refuses to start on a host whose name is not its SlurmctldHost.
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/none",
                "CredType=cred/none",
                "MpiDefault=none",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                # A rank that dies must not end its step (fault tolerance is the point).
                "KillOnBadExit=0",
                "ReturnToService=2",
                "SchedulerType=sched/builtin",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                # Finished jobs stay visible to `scontrol show job` for the test to read their state.
                "MinJobAge=600",
                "InactiveLimit=0",
                "KillWait=5",
                f"StateSaveLocation={d / 'state'}",
                f"SlurmdSpoolDir={d / 'spool'}",
                f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                f"SlurmdPidFile={d / 'slurmd.pid'}",
                f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
                f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                # Tests run more ranks than this machine has cores (sbatch -O / --overcommit).
                "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
                "",
            ])
        )

    def start(self) -> LocalSlurm:
        self.write_conf()
        env = self.env()
        for argv in ([_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)], [_binary("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)]):
            log = open(self.dir / "log" / (os.path.basename(argv[0]) + ".out"), "wb")
            self._procs.append(subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            ))
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        state = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with status {p.returncode} at start; its log:\n{self.logs()}")
            done = subprocess.run([_binary("sinfo"), "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True)
            state = done.stdout.strip()
            if done.returncode == 0 and state == "idle":
                return self
            time.sleep(0.3)
        raise RuntimeError(f"the local Slurm node did not become idle within {self.start_timeout_s:.0f} s (sinfo: {state!r}); logs:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            parts.append(f"--- {f.name} ---\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop both daemons (SIGTERM, then SIGKILL after 10 s) and every process they started; remove the directory."""
        for p in reversed(self._procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self._procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:  # slurmstepd and the job's tasks live in the daemon's group: nothing may outlive the fixture
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self._procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalSlurm:
        # A timeout (CI's `timeout` sends SIGTERM) must still run the teardown: SIGTERM becomes an
        # exception in the test process while the cluster is up (SIGKILL: see _die_with_parent).
        self._previous_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _terminated)
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            signal.signal(signal.SIGTERM, self._previous_term)

    # ------------------------------------------------------------------ jobs
    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (JobState, ExitCode, ...)."""
        out = subprocess.run([_binary("scontrol"), "show", "job", "-o", job_id], env=self.env(), capture_output=True, text=True, check=True).stdout
        fields = {}
        for item in out.split():
            key, eq, value = item.partition("=")
            if eq:
                fields[key] = value
        return fields

    def wait_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Poll until ``job_id`` has ended; its fields. Cancels it and raises on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job_state(job_id)
            if fields.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"):
                return fields
            if time.monotonic() > deadline:
                subprocess.run([_binary("scancel"), job_id], env=self.env())
                raise AssertionError(f"Slurm job {job_id} still {fields.get('JobState')} after {timeout_s:.0f} s; cancelled")
            time.sleep(0.5)
