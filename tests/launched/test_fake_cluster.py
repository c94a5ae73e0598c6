"""Unit tests of the fake-cluster harness (benchmarks.rigs.fake_cluster): no MPI job, a second or so each.

They need root and iproute2/util-linux, like the launched fake-host tests; without them the
harness raises MissingCapability and these tests fail, by design (CI runs as root).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.rigs import fake_netns as netns
from benchmarks.rigs.fake_cluster import FakeCluster
from benchmarks.rigs.fake_netns import MissingCapability

from harness.fake_hosts import reachable


def leftovers(prefix: str) -> list[str]:
    """Everything named after ``prefix`` that still exists: namespaces, /etc/netns entries, subnet claims."""
    found = [f"netns {ns}" for ns in netns.netns_list() if ns.startswith(prefix)]
    etc = Path("/etc/netns")
    if etc.is_dir():
        found += [f"/etc/netns/{e.name}" for e in etc.iterdir() if e.name.startswith(prefix)]
    if netns.CLAIMS.is_dir():
        found += [f"claim {c.name}" for c in netns.CLAIMS.iterdir() if c.read_text().strip() == prefix]
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def start_in(cluster: FakeCluster, host: int, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cluster.enter_argv(host) + argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster.wait_until(lambda: proc.pid in cluster.processes(host), 10, f"pid {proc.pid} in host {host}")
    return proc


def test_hosts_have_own_names_addresses_and_shm_and_teardown_leaves_nothing() -> None:
    machine = socket.gethostname()
    with FakeCluster(3) as cluster:
        prefix = cluster.prefix
        assert all(h.name.startswith(prefix) and h.port.startswith(prefix) and h.iface.startswith(prefix) for h in cluster.hosts)
        assert cluster.bridge.startswith(prefix) and cluster.switch.startswith(prefix)
        assert len({h.address for h in cluster.hosts}) == 3
        assert all(h.address.startswith(f"{netns.SUBNET_BASE}.{cluster.subnet_k}.") for h in cluster.hosts)
        for i, h in enumerate(cluster.hosts):
            assert cluster.run(i, ["hostname"]).stdout.strip() == h.name
            # Every host resolves every host, its own name included, to the private address (not 127.0.1.1).
            for other in cluster.hosts:
                assert cluster.run(i, ["getent", "hosts", other.name]).stdout.split()[0] == other.address
        # /dev/shm is the host's own: a file written on host 0 is seen on host 0 only.
        cluster.run(0, ["sh", "-c", f"echo x > /dev/shm/{prefix}-probe"])
        assert cluster.run(0, ["cat", f"/dev/shm/{prefix}-probe"]).stdout.strip() == "x"
        assert cluster.run(1, ["test", "-e", f"/dev/shm/{prefix}-probe"], check=False).returncode == 1
        assert not Path(f"/dev/shm/{prefix}-probe").exists()
        assert reachable(cluster, 0, 2) and reachable(cluster, 2, 1)
        sleepers = [start_in(cluster, i, ["sleep", "1000"]) for i in range(3)]
        anchors = [p.pid for p in cluster._anchors.values()]
        assert leftovers(prefix)
    assert leftovers(prefix) == []
    assert socket.gethostname() == machine  # hostnames were set in the hosts' own UTS namespaces only
    for proc in sleepers:
        assert proc.wait(timeout=5) == -signal.SIGKILL
    assert not any(alive(pid) for pid in anchors)


def test_own_name_loopback_gives_the_debian_hosts_file() -> None:
    with FakeCluster(2, own_name_loopback=True) as cluster:
        a, b = cluster.hosts
        assert cluster.run(0, ["getent", "hosts", a.name]).stdout.split()[0] == "127.0.1.1"
        assert cluster.run(0, ["getent", "hosts", b.name]).stdout.split()[0] == b.address


def test_teardown_after_an_exception_in_the_block() -> None:
    with pytest.raises(ValueError, match="boom"):
        with FakeCluster(2) as cluster:
            start_in(cluster, 1, ["sleep", "1000"])
            raise ValueError("boom")
    assert leftovers(cluster.prefix) == []


def test_concurrent_instances_get_their_own_names_and_subnets() -> None:
    with FakeCluster(2) as one, FakeCluster(2) as two:
        assert one.prefix != two.prefix and one.subnet != two.subnet
        assert reachable(one, 0, 1) and reachable(two, 0, 1)
    assert leftovers(one.prefix) == [] and leftovers(two.prefix) == []


def test_kill_ranks_spares_the_daemon_and_kill_host_takes_everything() -> None:
    with FakeCluster(2) as cluster:
        env = dict(os.environ, OMPI_COMM_WORLD_RANK="5")
        rank = start_in(cluster, 1, ["sleep", "1000"], env=env)
        daemon = start_in(cluster, 1, ["sleep", "1001"])  # no rank environment: stands for Open MPI's prted
        elsewhere = start_in(cluster, 0, ["sleep", "1002"], env=env)
        assert cluster.ranks(1) == {rank.pid: 5}
        assert cluster.kill_ranks(1) == [5]
        assert rank.wait(timeout=5) == -signal.SIGKILL
        assert alive(daemon.pid) and alive(elsewhere.pid)
        killed = cluster.kill_host(1)
        assert daemon.pid in killed and daemon.wait(timeout=5) == -signal.SIGKILL
        assert cluster.processes(1) == [] and alive(elsewhere.pid)
        with pytest.raises(netns.FakeClusterError, match="is down"):
            cluster.enter_argv(1)
        # Open MPI's ssh stand-in refuses the lost host, as ssh to a dead node fails.
        refused = subprocess.run([str(cluster.agent), cluster.hosts[1].name, "true"], capture_output=True, text=True)
        assert refused.returncode == 255 and "is down" in refused.stderr
        assert subprocess.run([str(cluster.agent), cluster.hosts[0].name, "hostname"], capture_output=True, text=True).stdout.strip() == (
            cluster.hosts[0].name
        )
        # Rebooted: a fresh host on the same name and address (empty /dev/shm), reachable again.
        cluster.revive(1)
        again = subprocess.run([str(cluster.agent), cluster.hosts[1].name, "sh", "-c", "hostname; ls /dev/shm | wc -l"],
                               capture_output=True, text=True, timeout=30)
        assert again.returncode == 0 and again.stdout.split() == [cluster.hosts[1].name, "0"], again
        assert reachable(cluster, 0, 1)


def test_the_ssh_stand_in_refuses_a_cut_off_host_and_never_answers_for_a_frozen_one() -> None:
    # What the supervisor's probe (and mpiexec starting a daemon) meets, as with ssh on a real cluster.
    from lightning_recover.cli.hosts import probe_unreachable
    from lightning_recover.cli.supervision import Host

    with FakeCluster(3) as cluster:
        hosts = [Host(h.name, 1) for h in cluster.hosts[1:]]
        extra = ["--prtemca", "plm_ssh_agent", str(cluster.agent)]
        assert probe_unreachable(hosts, extra, timeout_s=10) == frozenset()
        cluster.partition(1)
        cluster.freeze(2)
        refused = subprocess.run([str(cluster.agent), cluster.hosts[1].name, "true"], capture_output=True, text=True, timeout=30)
        assert refused.returncode == 255 and "No route to host" in refused.stderr
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run([str(cluster.agent), cluster.hosts[2].name, "true"], capture_output=True, timeout=2)
        assert probe_unreachable(hosts, extra, timeout_s=2) == {cluster.hosts[1].name, cluster.hosts[2].name}
        cluster.heal(1)
        cluster.thaw(2)
        assert probe_unreachable(hosts, extra, timeout_s=10) == frozenset()


def test_freeze_and_thaw_stop_and_resume_every_process_of_a_host() -> None:
    with FakeCluster(2) as cluster:
        env = dict(os.environ, OMPI_COMM_WORLD_RANK="3")
        start_in(cluster, 1, ["sleep", "1000"], env=env)
        other = start_in(cluster, 0, ["sleep", "1000"], env=dict(os.environ, OMPI_COMM_WORLD_RANK="0"))
        frozen = cluster.freeze(1)
        assert set(frozen) == set(cluster.processes(1))
        assert cluster.stopped_ranks(1) == [3] and cluster.stopped_ranks(0) == []
        assert netns.state_of(other.pid) == "S"
        cluster.thaw(1)
        cluster.wait_until(lambda: cluster.stopped_ranks(1) == [], 5, "host 1 thawed")


def test_partition_heal_and_flap() -> None:
    with FakeCluster(3) as cluster:
        cluster.partition(1)
        assert not reachable(cluster, 0, 1) and not reachable(cluster, 1, 2)
        assert reachable(cluster, 0, 2)
        cluster.heal(1)
        cluster.wait_until(lambda: reachable(cluster, 0, 1), 10, "host 1 reachable after heal")
        timer = cluster.flap(2, down_s=1.5)
        assert not reachable(cluster, 0, 2, timeout=0.5)
        timer.join(timeout=5)
        cluster.wait_until(lambda: reachable(cluster, 0, 2), 10, "host 2 reachable after the flap")


def test_a_missing_capability_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip, unshare, nsenter, setsid
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(MissingCapability) as info:
        FakeCluster(2).start()
    message = str(info.value)
    for needed in ("root", "'ip'", "iproute2", "'unshare'", "'nsenter'", "'setsid'"):
        assert needed in message, message


def _child(body: str) -> subprocess.Popen[str]:
    """A python process that builds a cluster, prints its prefix, then runs ``body``."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from benchmarks.rigs.fake_cluster import FakeCluster
        c = FakeCluster(2).start()
        print(c.prefix, flush=True)
        {body}
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)


def test_sigterm_tears_down_and_still_ends_the_process() -> None:
    child = _child("time.sleep(60)")
    assert child.stdout is not None
    prefix = child.stdout.readline().strip()
    assert prefix.startswith(netns.NAME_ROOT) and leftovers(prefix)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM
    assert leftovers(prefix) == []


def test_cleanup_stale_removes_what_a_killed_owner_left() -> None:
    child = _child("time.sleep(60)")
    assert child.stdout is not None
    prefix = child.stdout.readline().strip()
    child.kill()  # SIGKILL: no teardown runs
    child.wait(timeout=10)
    assert leftovers(prefix)
    assert prefix in netns.cleanup_stale()
    assert leftovers(prefix) == []


def test_prefixes_fit_linux_link_names() -> None:
    prefix = netns.new_prefix()
    assert netns._owner_pid(prefix) == os.getpid()
    assert len(prefix + "p99") <= 15  # IFNAMSIZ - 1
