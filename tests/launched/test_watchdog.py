"""The hang watchdog kills a stopped process on this host, and leaves live or finished ones alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_recover.runtime.watchdog import ENV_TIMEOUT, HangWatchdog, default_hang_timeout

CHILD = """
import sys, time
from pathlib import Path
from lightning_recover.runtime.watchdog import HangWatchdog
w = HangWatchdog(int(sys.argv[2]), 30.0, period=0.05, directory=Path(sys.argv[1])).start()
print("ready", flush=True)
while True:
    time.sleep(0.01)
    w.tick()
"""


def _child(directory: Path, rank: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(rank)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _wait_dead(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def test_stopped_peer_is_killed(tmp_path: Path) -> None:
    peer = _child(tmp_path, 1)
    try:
        dog = HangWatchdog(0, 0.5, period=0.05, directory=tmp_path).start()
        time.sleep(1.0)
        assert peer.poll() is None, "a live, heart-beating peer must not be killed"
        os.kill(peer.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        status = _wait_dead(peer, 10)
        assert status == -signal.SIGKILL, f"stopped peer not killed (status {status})"
        print(f"stopped peer killed after {time.monotonic() - t0:.2f}s (timeout 0.5 s)")
        assert "hung or stopped" in dog.killed[1]
        dog.stop()
    finally:
        peer.kill()


def test_stuck_in_compute_needs_progress_rule(tmp_path: Path) -> None:
    # A peer that heart-beats but never ticks and is not in a collective.
    (tmp_path / "1.json").write_text(json.dumps({"rank": 1, "pid": 999999, "start": None, "time": time.time() + 3600, "progress": 5, "computing": True}))
    dog = HangWatchdog(0, 5.0, stuck_timeout=0.3, period=0.05, directory=tmp_path).start()
    time.sleep(0.8)
    dog.stop()
    assert "stuck in compute" in dog.killed.get(1, ""), dog.killed


def test_waiting_or_between_steps_is_not_stuck(tmp_path: Path) -> None:
    (tmp_path / "1.json").write_text(json.dumps({"rank": 1, "pid": 999999, "start": None, "time": time.time() + 3600, "progress": 5, "computing": False}))
    dog = HangWatchdog(0, 5.0, stuck_timeout=0.3, period=0.05, directory=tmp_path).start()
    time.sleep(0.8)
    dog.stop()
    assert dog.killed == {}


def test_finished_rank_withdraws_its_heartbeat(tmp_path: Path) -> None:
    dog = HangWatchdog(3, 1.0, period=0.05, directory=tmp_path / "job").start()
    assert (tmp_path / "job" / "3.json").exists()
    dog.stop()
    assert not (tmp_path / "job").exists()


def test_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TIMEOUT, raising=False)
    assert default_hang_timeout() == 10.0
    monkeypatch.setenv(ENV_TIMEOUT, "4")
    assert default_hang_timeout() == 4.0
    monkeypatch.setenv(ENV_TIMEOUT, "0")
    assert default_hang_timeout() is None
    monkeypatch.setenv(ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="'soon' is not a number"):
        default_hang_timeout()
    with pytest.raises(ValueError, match="hang_timeout must be > 0 seconds, got -1"):
        HangWatchdog(0, -1)


def test_the_launcher_removes_the_heartbeat_directories_its_killed_ranks_left(tmp_path: Path) -> None:
    """A SIGKILLed rank never withdraws its heartbeat; once mpiexec (pid 4242 here) exited the
    launcher removes its jobs' directories (its own namespace and its spawns'), no other job's."""
    from lightning_recover.runtime.watchdog import remove_launch_directories

    ours = [tmp_path / "lightning-recover-prterun-node1-4242_1", tmp_path / "lightning-recover-prterun-node1-4242_3"]
    others = [tmp_path / "lightning-recover-prterun-node1-42421_1", tmp_path / "lightning-recover-prterun-node1-14242_1",
              tmp_path / "lightning-recover-local"]
    for d in ours + others:
        d.mkdir()
        (d / "2.json").write_text("{}")
    assert sorted(remove_launch_directories(4242, base=tmp_path)) == sorted(ours)
    assert [d.exists() for d in ours + others] == [False, False, True, True, True]


def test_the_launcher_removes_the_shared_memory_segments_nobody_maps(tmp_path: Path) -> None:
    """Open MPI's segment of a SIGKILLed rank stays in /dev/shm: after mpiexec exited the launcher
    removes this host's and user's segments made during the launch that no process maps, and
    keeps a mapped one (a live process, maybe of another job), an older one and other users'."""
    import mmap
    import socket

    from lightning_recover.cli.runner import remove_orphaned_segments

    prefix = f"sm_segment.{socket.gethostname()}.{os.getuid()}"
    orphan, mapped, old = tmp_path / f"{prefix}.1a2b0000.0", tmp_path / f"{prefix}.1a2b0000.1", tmp_path / f"{prefix}.99990000.0"
    other_user = tmp_path / f"sm_segment.{socket.gethostname()}.{os.getuid() + 1}.1a2b0000.0"
    for path in (orphan, mapped, old, other_user):
        path.write_bytes(b"\0" * 4096)
    since = time.time() - 0.5
    os.utime(old, (since - 60, since - 60))
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096) as view:
        assert view[0] == 0
        assert remove_orphaned_segments(since, base=tmp_path) == [orphan]
    assert [p.exists() for p in (orphan, mapped, old, other_user)] == [False, True, True, True]
