"""Fake hosts on one Linux machine: a real multi-host Open MPI job, and host-level faults.

Role: test support (the launched fake-host tests, the chaos campaign's ``--hosts N``). Needs
root, ``ip`` (iproute2), ``unshare``, ``nsenter`` and ``setsid`` (util-linux); a missing one
is a :class:`~benchmarks.rigs.fake_netns.MissingCapability` naming it, never a silent skip.
The machine's side of it (unique names, subnet claims, namespaces and their processes,
cleanup) is :mod:`benchmarks.rigs.fake_netns`; this module builds the hosts, runs
the launcher across them and applies the host faults.

What a fake host is
    A network namespace with one veth whose other end is a port of a bridge. The bridge
    lives in a namespace of its own (the *switch*), so no address, route or link of the
    machine's own network is touched: all traffic stays on a private ``10.77.K.0/24``
    (``K`` claimed free among concurrent instances under
    :data:`~benchmarks.rigs.fake_netns.CLAIMS`). Each host has
    ``/etc/netns/<host>/hosts`` naming every host by its private address -- its own name
    too, not ``127.0.1.1``, unless ``own_name_loopback=True`` asks for the Debian default
    (its own name on ``127.0.1.1``, the others on their addresses). An *anchor* process per
    host (``ip netns exec HOST unshare --uts --mount --ipc --propagation private``, then
    ``hostname HOST`` and a private tmpfs on ``/dev/shm``) holds the host's namespaces;
    every command for that host enters all of them with ``nsenter``, so all processes of a
    host share one hostname and one ``/dev/shm`` and no two hosts share either (ranks of
    different hosts sharing Open MPI's shared-memory files segfault).

Where mpiexec runs
    Inside the first host (:attr:`FakeCluster.head`), as on a real cluster where the job is
    started on its first node: Open MPI's head daemon (mpiexec itself) and that host's
    ranks live there, the other hosts get a ``prted`` started through the ssh stand-in
    (:attr:`FakeCluster.agent`, passed as ``plm_ssh_agent``), which enters the named host in
    a new session, as sshd would. Losing the head host therefore loses the job, as it does
    on a real cluster; the host-fault actions are meant for the other hosts.

Differences from real hosts (on purpose or unavoidable): one process-id space and one file
system for all hosts (a rank's files are where the test reads them; a kill by pid from the
harness reaches any host; the launcher's status directory, a temporary directory on the
head host, is seen by every host here, where a cluster without a shared ``/tmp`` would
keep the other hosts' markers from it), and the ssh stand-in keeps mpiexec's environment
(ssh would not), so ranks on other hosts see the launcher's environment variables.

Use::

    with FakeCluster(2) as cluster:                  # or the ``fake_cluster`` pytest fixture
        job = cluster.launch(4, ["python", "train.py"], env=..., timeout=120)
        cluster.kill_ranks(cluster.hosts[1])          # or kill_host, freeze/thaw, partition/heal, flap

Teardown (on ``__exit__``, at interpreter exit, on SIGTERM, and from the fixture's
finalizer) always kills every process of every namespace by pid, then deletes the
namespaces (and with them the veths and the bridge), the ``/etc/netns`` entries and the
subnet claim. :func:`~benchmarks.rigs.fake_netns.cleanup_stale` removes what an
instance whose process died left.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from benchmarks.rigs.fake_netns import (
    SUBNET_BASE,
    FakeClusterError,
    check_capabilities,
    claim_subnet,
    comm_of,
    delete_instance_names,
    environ_of,
    kill_namespace_processes,
    netns_list,
    netns_pids,
    new_prefix,
    run_command,
    signal_all,
    state_of,
)

#: Open MPI's runtime processes (never counted as ranks).
RUNTIME = {"mpiexec", "mpirun", "prterun", "prte", "prted"}


@dataclass(frozen=True)
class FakeHost:
    """One fake host: its name (hostname, namespace and ``/etc/netns`` entry) and private address."""

    name: str
    address: str
    #: The switch port (in the switch namespace) its link hangs on: a partition takes it down.
    port: str
    #: Its own end of the link (inside the host).
    iface: str


@dataclass
class LaunchResult:
    """One launcher run across the hosts: its exit status, output and wall time. Judge the run by what its ranks wrote."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    argv: list[str]


#: Environment that must not travel into a host from the harness's own environment.
_ENV_DROP = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMIX_NAMESPACE")

_AGENT = """#!/bin/sh
# ssh's stand-in for Open MPI (plm_ssh_agent), written by benchmarks.rigs.fake_cluster:
# "AGENT [options] HOST COMMAND..." runs COMMAND in HOST's namespaces, in a new session as sshd would.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host="$1"; shift
dir=$(dirname "$0")
echo "$(date +%s.%N) $host $*" >> "$dir/agent.log"
if [ ! -f "$dir/$host.pid" ]; then
    echo "fake-cluster agent: host '$host' is down or unknown (no $dir/$host.pid)" >&2
    exit 255
fi
# As ssh to a node behind a dead link fails, and to a frozen node never answers (its sshd is stopped).
if [ -f "$dir/$host.cut" ]; then
    echo "fake-cluster agent: connect to host $host: No route to host (its link is down)" >&2
    exit 255
fi
if [ -f "$dir/$host.frozen" ]; then
    exec sleep infinity
fi
pid=$(cat "$dir/$host.pid")
exec setsid -w nsenter -t "$pid" --net --uts --mount --ipc --wd="$PWD" -- /bin/sh -c "$*"
"""


def _replacement_rank(pid: int, world_rank: int) -> int | None:
    """The job's rank a process stands for: its world rank, unless it is a re-join replacement (its
    world is its spawn's; the seat in its argv names the rank it takes over) or a warm standby not
    yet seated (None: no rank of the job yet)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return world_rank
    if "lightning_recover.cli.joiner" not in argv:
        return world_rank
    at = argv.index("lightning_recover.cli.joiner") + 1
    if at >= len(argv) or argv[at] == "--standby":
        return None
    try:
        ranks = json.loads(argv[at])["ranks"]
        return int(ranks[world_rank])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


class FakeCluster:
    """``n_hosts`` fake hosts with ``slots`` MPI slots each; see the module docstring.

    A context manager: entering builds the hosts, leaving (also on an exception) tears
    everything down. ``own_name_loopback=True`` gives each host the Debian ``/etc/hosts``
    line ``127.0.1.1 <own name>``, as real Debian nodes have."""

    def __init__(self, n_hosts: int = 2, *, slots: int = 2, own_name_loopback: bool = False, shm_size: str = "2g") -> None:
        if not 1 <= n_hosts <= 99:
            raise ValueError(f"n_hosts must be 1..99, got {n_hosts}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.n_hosts, self.slots, self.own_name_loopback, self.shm_size = n_hosts, slots, own_name_loopback, shm_size
        self.prefix = new_prefix()
        self.switch = f"{self.prefix}sw"
        self.bridge = f"{self.prefix}br"
        self.subnet_k: int | None = None
        self.hosts: tuple[FakeHost, ...] = ()
        self.workdir: Path | None = None
        self._anchors: dict[str, subprocess.Popen[bytes]] = {}
        self._down: set[str] = set()
        self._timers: list[threading.Timer] = []
        self._started = False
        self._torn_down = False
        self._lock = threading.RLock()
        self._previous_sigterm: object = None

    # ------------------------------------------------------------------ properties
    @property
    def subnet(self) -> str:
        """The private network in CIDR form (what ``btl_tcp_if_include`` / ``oob_tcp_if_include`` get)."""
        if self.subnet_k is None:
            raise FakeClusterError("the cluster is not started; use 'with FakeCluster(...) as cluster'")
        return f"{SUBNET_BASE}.{self.subnet_k}.0/24"

    @property
    def head(self) -> FakeHost:
        """The host mpiexec runs on (the first)."""
        return self.hosts[0]

    @property
    def agent(self) -> Path:
        """The ssh stand-in script handed to Open MPI as ``plm_ssh_agent``."""
        assert self.workdir is not None, "the cluster is not started"
        return self.workdir / "agent"

    def host(self, which: FakeHost | str | int) -> FakeHost:
        """A host by object, name or index."""
        if isinstance(which, FakeHost):
            return which
        if isinstance(which, int):
            return self.hosts[which]
        for h in self.hosts:
            if h.name == which:
                return h
        raise KeyError(f"no fake host {which!r}; hosts are {[h.name for h in self.hosts]}")

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> FakeCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.teardown()

    def start(self) -> FakeCluster:
        """Build the switch, the hosts and the agent; on any failure, tear down what was built and raise."""
        check_capabilities()
        if self._started:
            raise FakeClusterError(f"fake cluster {self.prefix} was already started; make a new FakeCluster")
        self._started = True
        atexit.register(self.teardown)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_sigterm
        if previous == signal.SIG_IGN:
            return  # the process chose to ignore SIGTERM: it lives on, and so do its hosts
        self.teardown()
        if callable(previous):
            previous(signum, frame)
        else:  # default action: die of SIGTERM, as without the harness
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _build(self) -> None:
        self.subnet_k = claim_subnet(self.prefix)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.hosts = tuple(
            FakeHost(f"{self.prefix}n{i}", f"{SUBNET_BASE}.{self.subnet_k}.{i + 1}", f"{self.prefix}p{i}", f"{self.prefix}e{i}") for i in range(self.n_hosts)
        )
        run_command(["ip", "netns", "add", self.switch])
        run_command(["ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge"])
        run_command(["ip", "-n", self.switch, "link", "set", self.bridge, "up"])
        for h in self.hosts:
            run_command(["ip", "netns", "add", h.name])
            # Created in the switch namespace with its host end moved straight into the host: never in the machine's namespace.
            run_command(["ip", "-n", self.switch, "link", "add", h.port, "type", "veth", "peer", "name", h.iface, "netns", h.name])
            run_command(["ip", "-n", self.switch, "link", "set", h.port, "master", self.bridge, "up"])
            run_command(["ip", "-n", h.name, "addr", "add", f"{h.address}/24", "dev", h.iface])
            run_command(["ip", "-n", h.name, "link", "set", h.iface, "up"])
            run_command(["ip", "-n", h.name, "link", "set", "lo", "up"])
            self._write_hosts_file(h)
        for h in self.hosts:
            self._start_anchor(h)
        self.agent.write_text(_AGENT)
        self.agent.chmod(0o755)

    def _write_hosts_file(self, me: FakeHost) -> None:
        lines = ["127.0.0.1 localhost"]
        for h in self.hosts:
            addr = "127.0.1.1" if (h is me and self.own_name_loopback) else h.address
            lines.append(f"{addr} {h.name}")
        path = Path("/etc/netns") / me.name
        path.mkdir(parents=True, exist_ok=True)
        (path / "hosts").write_text("\n".join(lines) + "\n")

    def _start_anchor(self, h: FakeHost) -> None:
        """The process that holds ``h``'s UTS, mount and IPC namespaces (own hostname, own /dev/shm)."""
        script = 'hostname "$1" && mount -t tmpfs -o size="$2" tmpfs /dev/shm && exec sleep infinity'
        argv = ["ip", "netns", "exec", h.name, "unshare", "--uts", "--mount", "--ipc", "--propagation", "private",
                "sh", "-c", script, "anchor", h.name, self.shm_size]
        # ip netns exec, unshare and sh all exec in place: the Popen pid becomes the anchor's ``sleep``.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._anchors[h.name] = proc
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise FakeClusterError(f"host {h.name}: {shlex.join(argv)} exited with {proc.returncode}: {err.strip()}")
            try:
                if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise FakeClusterError(f"host {h.name}: its anchor process did not come up in 15 s")
            time.sleep(0.02)
        assert self.workdir is not None
        (self.workdir / f"{h.name}.pid").write_text(f"{proc.pid}\n")

    def teardown(self) -> None:
        """Kill every process of every namespace, delete namespaces, links, /etc/netns entries and the subnet claim. Idempotent."""
        with self._lock:
            if self._torn_down or not self._started:
                return
            self._torn_down = True
        for timer in self._timers:
            timer.cancel()
        errors = []
        for ns in [h.name for h in self.hosts] + [self.switch]:
            try:
                kill_namespace_processes(ns)
            except FakeClusterError as exc:
                errors.append(str(exc))
        for proc in self._anchors.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                errors.append(f"anchor {proc.pid} did not exit")
            if proc.stderr:
                proc.stderr.close()
        for ns in [h.name for h in self.hosts] + [self.switch]:
            if ns in netns_list():
                proc = run_command(["ip", "netns", "del", ns], check=False)
                if proc.returncode != 0:
                    errors.append(f"ip netns del {ns}: {proc.stderr.strip()}")
        delete_instance_names(self.prefix)  # anything else named after this instance, and the claim
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        try:
            atexit.unregister(self.teardown)
        except Exception:  # noqa: BLE001, S110 - interpreter shutting down
            pass
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
            except (ValueError, TypeError):
                pass
        if errors:
            raise FakeClusterError("fake cluster teardown incomplete: " + "; ".join(errors))

    # ------------------------------------------------------------------ running commands
    def enter_argv(self, host: FakeHost | str | int, cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """The argv prefix that runs a command inside ``host`` (all of its namespaces, working directory ``cwd``)."""
        h = self.host(host)
        if h.name in self._down or h.name not in self._anchors:
            raise FakeClusterError(f"host {h.name} is down (killed whole); nothing can run on it")
        return ["nsenter", "-t", str(self._anchors[h.name].pid), "--net", "--uts", "--mount", "--ipc",
                f"--wd={os.fspath(cwd) if cwd is not None else os.getcwd()}", "--"]

    def run(self, host: FakeHost | str | int, argv: Sequence[str], *, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host`` and wait for it."""
        return run_command(self.enter_argv(host) + list(argv), check=check, timeout=timeout)

    def mpi_args(self, *, map_by: str | None = None, slots: int | None = None, hosts: int | None = None) -> list[str]:
        """mpiexec arguments that place the job on the hosts (``slots`` per host; the first ``hosts`` hosts, default
        all) over the private network only."""
        per_host = slots if slots is not None else self.slots
        used = self.hosts if hosts is None else self.hosts[:hosts]
        if hosts is not None and not 1 <= hosts <= len(self.hosts):
            raise ValueError(f"hosts={hosts} must be 1..{len(self.hosts)} (this cluster has {len(self.hosts)} hosts)")
        args = [
            "--host", ",".join(f"{h.name}:{per_host}" for h in used),
            "--prtemca", "plm_ssh_agent", str(self.agent),
            # mpiexec starts every daemon itself (no daemon-to-daemon tree): the agent lives on the head host only.
            "--prtemca", "plm_ssh_no_tree_spawn", "1",
            "--prtemca", "oob_tcp_if_include", self.subnet,
            "--mca", "btl_tcp_if_include", self.subnet,
            # The hosts share the machine's cores: per-host bindings would clash.
            "--bind-to", "none",
            "--mca", "btl", "tcp,sm,self",
        ]
        if map_by is not None:
            args += ["--map-by", map_by]
        return args

    def launcher_argv(
        self,
        nprocs: int,
        command: Sequence[str],
        *,
        hang_timeout: float | None = None,
        mpi_detector: bool = False,
        map_by: str | None = None,
        extra: Sequence[str] = (),
        cwd: str | os.PathLike[str] | None = None,
        launcher_options: Sequence[str] = (),
        slots: int | None = None,
        hosts: int | None = None,
    ) -> list[str]:
        """``python -m lightning_recover.cli launch -n N ... -- COMMAND`` run on the head host, placing ranks on all hosts.

        ``launcher_options``: more options of ``lightning-recover launch`` (``--status-dir D``, ``--supervise`` ...);
        with ``--supervise`` the hosts go to the launcher's ``--hosts`` instead of mpiexec's ``--host``.

        ``map_by``: Open MPI's ``--map-by`` (``node``: rank r on host r % n_hosts, so a
        replica of consecutive ranks spans hosts; default: fill each host's slots in turn).
        ``slots``: MPI slots per host for this job (default: the cluster's); ``hosts``: use
        only the first ``hosts`` hosts (default: all), so one cluster serves jobs of several shapes."""
        launch = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(nprocs)]
        if hang_timeout is not None:
            launch += ["--hang-timeout", f"{hang_timeout:g}"]
        if mpi_detector:
            launch.append("--mpi-detector")
        mpi = self.mpi_args(map_by=map_by, slots=slots, hosts=hosts)
        if "--supervise" in launcher_options:
            # The supervisor places the job itself (--hosts), and drops the hosts it finds lost.
            at = mpi.index("--host")
            launch += ["--hosts", mpi[at + 1]]
            mpi = mpi[:at] + mpi[at + 2 :]
        # "--mpi-arg=VALUE": VALUE itself starts with dashes, which argparse would take for an option otherwise.
        launch += [*launcher_options, *(f"--mpi-arg={a}" for a in [*mpi, *extra])]
        return self.enter_argv(self.head, cwd) + launch + ["--", *command]

    def launch(
        self,
        nprocs: int,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
        cwd: str | os.PathLike[str] | None = None,
        during: Callable[[subprocess.Popen[str]], None] | None = None,
        **options: object,
    ) -> LaunchResult:
        """Run the launcher (see :meth:`launcher_argv` for ``options``) and wait at most ``timeout`` s.

        ``during(proc)`` runs on this thread while the job runs (inject faults there). On
        timeout, SIGTERM to the launcher (it forwards it to mpiexec), then every process of
        every host is killed and :class:`TimeoutError` raised with the output so far."""
        argv = self.launcher_argv(nprocs, command, cwd=cwd, **options)  # type: ignore[arg-type]
        full_env = {k: v for k, v in (os.environ if env is None else env).items() if k not in _ENV_DROP}
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        out: dict[str, str] = {}
        readers = [threading.Thread(target=lambda k=k, s=s: out.__setitem__(k, s.read()), daemon=True)
                   for k, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for r in readers:
            r.start()
        try:
            if during is not None:
                during(proc)
            proc.wait(timeout=max(0.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            self.kill_everything()
            proc.wait()
            for r in readers:
                r.join(timeout=5)
            raise TimeoutError(
                f"the job did not end in {timeout}s; every process on the fake hosts was killed\n"
                f"--- stdout ---\n{out.get('stdout', '')[-3000:]}\n--- stderr ---\n{out.get('stderr', '')[-5000:]}"
            ) from None
        except BaseException:
            self.kill_everything()
            proc.wait()
            raise
        for r in readers:
            r.join(timeout=30)
        return LaunchResult(proc.returncode, out.get("stdout", ""), out.get("stderr", ""), time.monotonic() - t0, argv)

    # ------------------------------------------------------------------ looking at hosts
    def processes(self, host: FakeHost | str | int) -> list[int]:
        """Every process in ``host``'s network namespace (its anchor, daemon, ranks, a launcher there)."""
        return netns_pids(self.host(host).name)

    def ranks(self, host: FakeHost | str | int) -> dict[int, int]:
        """``pid -> MPI world rank`` of the job's rank processes on ``host`` (children such as loader workers included)."""
        anchor = self._anchors.get(self.host(host).name)
        found = {}
        for pid in self.processes(host):
            if anchor is not None and pid == anchor.pid:
                continue
            rank = environ_of(pid).get("OMPI_COMM_WORLD_RANK")
            if rank is not None and rank.isdigit() and comm_of(pid) not in RUNTIME:
                logical = _replacement_rank(pid, int(rank))
                if logical is not None:
                    found[pid] = logical
        return found

    def stopped_ranks(self, host: FakeHost | str | int) -> list[int]:
        """World ranks on ``host`` whose process is stopped (state T: SIGSTOP, e.g. a ``hang`` fault)."""
        return sorted({rank for pid, rank in self.ranks(host).items() if state_of(pid) in ("T", "t")})

    def wait_until(self, predicate: Callable[[], object], timeout: float, what: str) -> object:
        """Poll ``predicate`` every 50 ms until it returns something truthy; :class:`TimeoutError` naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout}s for {what}")
            time.sleep(0.05)

    # ------------------------------------------------------------------ host faults
    def kill_ranks(self, host: FakeHost | str | int) -> list[int]:
        """SIGKILL every rank process on ``host`` at once; Open MPI's daemon there lives on. Returns the world ranks killed."""
        found = self.ranks(host)
        signal_all(found, signal.SIGKILL)
        return sorted(set(found.values()))

    def kill_host(self, host: FakeHost | str | int) -> list[int]:
        """Lose ``host`` whole: every process in its namespace (ranks, Open MPI's daemon, its anchor) SIGKILLed.
        The host stays down (nothing can be started on it). Returns the pids killed."""
        h = self.host(host)
        pids = self.processes(h)
        with self._lock:
            self._down.add(h.name)
            if self.workdir is not None:
                (self.workdir / f"{h.name}.pid").unlink(missing_ok=True)  # the agent now refuses it, like ssh to a dead node
        kill_namespace_processes(h.name)
        return pids

    def revive(self, host: FakeHost | str | int) -> None:
        """Bring a host lost whole (:meth:`kill_host`) back, as a rebooted node: a fresh anchor (new hostname
        namespace, empty ``/dev/shm``) on the same address; the agent reaches it again."""
        h = self.host(host)
        with self._lock:
            if h.name not in self._down:
                return
            old = self._anchors.pop(h.name, None)
            if old is not None:
                old.wait(timeout=5)
                if old.stderr:
                    old.stderr.close()
            self._start_anchor(h)
            self._down.discard(h.name)

    def freeze(self, host: FakeHost | str | int) -> list[int]:
        """SIGSTOP every process on ``host`` (a frozen node; the agent no longer answers for it, like ssh to
        a node whose sshd is stopped); :meth:`thaw` resumes them. Returns the pids stopped."""
        self._mark(host, "frozen", True)
        pids = self.processes(host)
        signal_all(pids, signal.SIGSTOP)
        return pids

    def thaw(self, host: FakeHost | str | int) -> None:
        """SIGCONT every process on ``host``."""
        signal_all(self.processes(host), signal.SIGCONT)
        self._mark(host, "frozen", False)

    def partition(self, host: FakeHost | str | int) -> None:
        """Cut ``host`` off the network: its switch port goes down (the host keeps its address, routes and
        processes; the agent refuses it, as ssh would: no route to host)."""
        self._mark(host, "cut", True)
        run_command(["ip", "-n", self.switch, "link", "set", self.host(host).port, "down"])

    def heal(self, host: FakeHost | str | int) -> None:
        """Bring ``host``'s switch port back up."""
        run_command(["ip", "-n", self.switch, "link", "set", self.host(host).port, "up"])
        self._mark(host, "cut", False)

    def _mark(self, host: FakeHost | str | int, state: str, on: bool) -> None:
        """The agent's view of ``host`` (a file ``HOST.STATE`` beside it: ``cut`` or ``frozen``)."""
        if self.workdir is None:
            return
        path = self.workdir / f"{self.host(host).name}.{state}"
        if on:
            path.touch()
        else:
            path.unlink(missing_ok=True)

    def flap(self, host: FakeHost | str | int, down_s: float = 3.0) -> threading.Timer:
        """Take ``host``'s link down now and back up after ``down_s`` seconds (returns at once; the timer heals)."""
        if not down_s > 0:
            raise ValueError(f"down_s must be > 0 seconds, got {down_s}")
        self.partition(host)
        timer = threading.Timer(down_s, self._heal_quietly, args=(self.host(host),))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()
        return timer

    def _heal_quietly(self, host: FakeHost) -> None:
        if not self._torn_down:
            try:
                self.heal(host)
            except FakeClusterError as exc:
                print(f"[fake-cluster] healing {host.name} failed: {exc}", file=sys.stderr, flush=True)

    def kill_everything(self) -> None:
        """SIGKILL every process on every host (the anchors excepted): ends a job, keeps the hosts."""
        anchors = {p.pid for p in self._anchors.values()}
        for h in self.hosts:
            for pid in self.processes(h):
                if pid not in anchors:
                    for sig in (signal.SIGKILL, signal.SIGCONT):
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
