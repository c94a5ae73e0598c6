"""A real multi-node Slurm on fake hosts: one ``slurmd`` per fake host, ``slurmctld`` on the bridge.

Each fake host (:class:`~benchmarks.rigs.fake_cluster.FakeCluster`: a network
namespace with its own hostname and ``/dev/shm``) runs one ``slurmd`` under its own
NodeName, entered into all of the host's namespaces, so what Slurm starts on a node (the
batch script, the ``srun`` that Open MPI's runtime uses to start its daemon ``prted`` on the
other nodes, and the ranks) lives on that host. ``slurmctld`` runs in the switch namespace
with an address on the bridge, reachable from every host. The client commands (``sbatch``,
``scontrol``, ``sinfo``) run beside the controller, as on a login node, so they outlive any
compute node (:meth:`SlurmOnHosts.client`).

The configuration is the one-node test's (tests/harness/slurm_cluster.py: no authentication
daemon, Linux process tracking, no task plugin, CPUs as the consumable resource) with one
difference that matters for node faults: ``SlurmdTimeout`` is short (:data:`NODE_TIMEOUT_S`)
so the controller marks a lost node DOWN within seconds, not Slurm's default 5 minutes, and a
requeued job may start again after :data:`REQUEUE_WAIT_S` (``cred_expire``), not 2 minutes.

Every daemon is started in its own process group with ``PR_SET_PDEATHSIG`` and stopped by
pid on :meth:`SlurmOnHosts.stop` (on a normal end, a failing test and a timeout: the
fixture calls it in a ``finally``); the fake hosts' own teardown then kills whatever is left
in their namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.rigs.fake_cluster import FakeCluster
from harness.slurm_cluster import _binary, _die_with_parent, missing_requirements

#: How long a node may stay silent before slurmctld marks it DOWN (Slurm's SlurmdTimeout; its default is 300 s).
NODE_TIMEOUT_S = 6
#: How long a requeued job must wait before it starts again (Slurm's ``cred_expire``; its default is 120 s).
REQUEUE_WAIT_S = 10
#: The controller's address on the bridge: the last of the fake subnet.
_CTLD_HOST_OCTET = 254
_ENDED = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING")


class SlurmOnHosts:
    """``slurmctld`` on ``cluster``'s bridge and one ``slurmd`` per host (NodeName = the host's name, ``cpus`` CPUs)."""

    def __init__(self, cluster: FakeCluster, cpus: int = 1, start_timeout_s: float = 90.0) -> None:
        why = missing_requirements()
        if why is not None:
            raise RuntimeError(why)
        self.cluster = cluster
        self.cpus = cpus
        self.start_timeout_s = start_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="lr-slurm-hosts-"))
        self.conf = self.dir / "slurm.conf"
        self.ctld: subprocess.Popen[bytes] | None = None
        self.slurmd: dict[str, subprocess.Popen[bytes]] = {}
        prefix = cluster.subnet.rsplit(".", 1)[0]
        self.ctld_address = f"{prefix}.{_CTLD_HOST_OCTET}"

    # ------------------------------------------------------------------ set-up
    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(exist_ok=True)
        d = self.dir
        nodes = [f"NodeName={h.name} NodeAddr={h.address} CPUs={self.cpus} State=UNKNOWN" for h in self.cluster.hosts]
        names = ",".join(h.name for h in self.cluster.hosts)
        self.conf.write_text("\n".join([
            "ClusterName=lrhosts",
            # slurmctld runs in the switch namespace, which keeps the machine's hostname.
            f"SlurmctldHost={socket.gethostname()}({self.ctld_address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            # How long a requeued job waits before it may start again (Slurm's default: 120 s).
            f"AuthInfo=cred_expire={REQUEUE_WAIT_S}",
            "CredType=cred/none",
            "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "KillOnBadExit=0",
            # A node whose slurmd comes back (a rebooted host) returns to service by itself.
            "ReturnToService=2",
            f"SlurmdTimeout={NODE_TIMEOUT_S}",
            "SchedulerType=sched/builtin",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=600",
            "InactiveLimit=0",
            "KillWait=5",
            f"StateSaveLocation={d / 'state'}",
            # One directory, pid file and log per node: %n is the NodeName slurmd runs as.
            f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.%n.log'}",
            *nodes,
            f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
            "",
        ]))

    def _spawn(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.dir / "log" / log_name, "ab") as log:
            return subprocess.Popen(list(argv), env=self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)

    def _mount_cgroups(self, host: int) -> None:
        """Give ``host`` the machine's cgroup file systems: slurmd (22.05) will not start without them, and the
        host's mount namespace (``ip netns exec`` mounts a fresh ``/sys``) has none."""
        mounts = [line.split()[:4] for line in Path("/proc/self/mounts").read_text().splitlines()]
        script = [
            ("" if point == "/sys/fs/cgroup" else f"mkdir -p {point} && ") + f"mount -t {fstype} -o {opts} {src} {point} || exit 1"
            for src, point, fstype, opts in mounts if point == "/sys/fs/cgroup" or point.startswith("/sys/fs/cgroup/")
        ]
        if script:
            self.cluster.run(host, ["sh", "-c", "\n".join(script)])

    def start_slurmd(self, host: int) -> None:
        """Start (or, after the host was lost and revived, restart) the ``slurmd`` of host ``host``."""
        h = self.cluster.host(host)
        self._mount_cgroups(host)
        (self.dir / "spool" / h.name).mkdir(parents=True, exist_ok=True)
        # nsenter and slurmd -D exec in place: the Popen pid is slurmd's.
        self.slurmd[h.name] = self._spawn(
            [*self.cluster.enter_argv(h, self.dir), _binary("slurmd"), "-D", "-N", h.name, "-f", str(self.conf)], f"slurmd.{h.name}.out"
        )

    def start(self) -> SlurmOnHosts:
        self._write_conf()
        sw = self.cluster.switch
        subprocess.run(["ip", "-n", sw, "addr", "add", f"{self.ctld_address}/24", "dev", self.cluster.bridge], check=True, capture_output=True)
        # The clients run beside the controller, and a connection to an address of one's own goes over loopback.
        subprocess.run(["ip", "-n", sw, "link", "set", "lo", "up"], check=True, capture_output=True)
        self.ctld = self._spawn(["ip", "netns", "exec", sw, _binary("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for i in range(len(self.cluster.hosts)):
            self.start_slurmd(i)
        self.wait_nodes("idle", range(len(self.cluster.hosts)), self.start_timeout_s)
        return self

    def wait_nodes(self, state: str, hosts: Sequence[int] | range, timeout_s: float) -> None:
        """Until ``sinfo`` shows every host of ``hosts`` in ``state`` (``idle``, ``down`` ...)."""
        names = {self.cluster.host(i).name for i in hosts}
        deadline = time.monotonic() + timeout_s
        seen: dict[str, str] = {}
        while True:
            if self.ctld is not None and self.ctld.poll() is not None:
                raise RuntimeError(f"slurmctld exited with status {self.ctld.returncode}; logs:\n{self.logs()}")
            done = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            seen = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
            if done.returncode == 0 and all(seen.get(n, "").rstrip("*~#!%$@^-") == state for n in names):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes {sorted(names)} not {state} within {timeout_s:.0f} s (sinfo: {seen}); logs:\n{self.logs()}")
            time.sleep(0.3)

    def client(self, argv: Sequence[str], *, check: bool = True, timeout: float = 60, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command beside the controller (the login node; no compute node, so it outlives any of them)."""
        full = ["ip", "netns", "exec", self.cluster.switch, _binary(argv[0]), *argv[1:]]
        return subprocess.run(full, env=self.env(env), capture_output=True, text=True, timeout=timeout, check=check,
                              cwd=cwd if cwd is not None else self.dir)

    def logs(self) -> str:
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            parts.append(f"--- {f.name} ---\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    # ------------------------------------------------------------------ teardown
    def stop(self) -> None:
        """Stop every daemon by pid (SIGTERM to its process group, SIGKILL after 10 s) and remove the directory."""
        procs = [*self.slurmd.values(), *([self.ctld] if self.ctld is not None else [])]
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self.slurmd.clear()
        self.ctld = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmOnHosts:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs
    def submit(self, args: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike[str]) -> str:
        done = self.client(["sbatch", "--parsable", *args], env=env, cwd=cwd, check=False)
        if done.returncode != 0:
            raise AssertionError(f"sbatch failed ({done.returncode}): {done.stderr}")
        return done.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> dict[str, str]:
        out = self.client(["scontrol", "show", "job", "-o", job_id]).stdout
        return {k: v for k, eq, v in (item.partition("=") for item in out.split()) if eq}

    def wait_job(self, job_id: str, timeout_s: float, *, restarts: int = 0) -> dict[str, str]:
        """Poll until ``job_id`` has ended (after at least ``restarts`` requeues); its fields. Cancels it and raises on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job_state(job_id)
            if fields.get("JobState") not in _ENDED and int(fields.get("Restarts", "0")) >= restarts:
                return fields
            if time.monotonic() > deadline:
                self.client(["scancel", job_id], check=False)
                raise AssertionError(f"Slurm job {job_id} still {fields.get('JobState')} after {timeout_s:.0f} s; cancelled\n{fields}\n{self.logs()}")
            time.sleep(0.5)
