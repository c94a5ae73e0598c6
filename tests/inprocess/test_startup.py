"""The launcher's start watch (lightning_recover.cli.startup) and the job's last line for a rank lost at start,
on status directories written here and a scripted process list (the launched tests kill real ranks)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from lightning_recover.cli.job_status import START_LOST_STATUS, JobMarkers, final_words
from lightning_recover.cli.runner import START_LOST_STATUS as RUNNER_STATUS
from lightning_recover.cli.startup import (
    DEFAULT_START_TIMEOUT_S,
    StartWatch,
    rank_of,
    start_timeout,
)

HERE = socket.gethostname()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch(tmp_path: Path, nprocs: int = 3, **options: object) -> tuple[StartWatch, Clock, dict[int, int]]:
    """A watch whose processes are pids 100 + rank, known by ``ranks`` (pid -> rank)."""
    clock = Clock()
    ranks: dict[int, int] = {}
    w = StartWatch(str(tmp_path), nprocs, clock=clock, rank_of=ranks.get, timeout_s=60, **options)  # type: ignore[arg-type]
    return w, clock, ranks


def mark(tmp_path: Path, name: str, text: str = "", mtime: float | None = None) -> None:
    (tmp_path / name).write_text(text)
    if mtime is not None:
        os.utime(tmp_path / name, (mtime, mtime))


def test_a_local_rank_gone_before_its_communicator_is_named_with_its_host_after_the_grace(tmp_path: Path) -> None:
    w, clock, ranks = watch(tmp_path)
    ranks.update({100: 0, 101: 1, 102: 2})
    assert w.poll(lambda: [100, 101, 102]) is None
    mark(tmp_path, "init.0", "hostA 100")
    assert w.poll(lambda: [100, 102]) is None  # rank 1 gone: the grace starts
    clock.now += 2.5
    line = w.poll(lambda: [100, 102])
    assert line is not None and line.startswith(f"lost while the job started, before its first step: rank 1 on host {HERE}, whose process ended")
    assert "relaunch" in line and f"Exit status {START_LOST_STATUS}" in line
    assert w.poll(list) is None, "said once"


def test_a_rank_of_a_script_without_the_strategy_may_simply_finish(tmp_path: Path) -> None:
    w, clock, ranks = watch(tmp_path)
    ranks.update({100: 0, 101: 1, 102: 2})
    w.poll(lambda: [100, 101, 102])
    clock.now += 5
    assert w.poll(lambda: [100, 102]) is None
    clock.now += 5  # no init marker ever: nothing tells a finished rank from a lost one
    assert w.poll(lambda: [100, 102]) is None


def test_a_rank_never_seen_on_a_single_host(tmp_path: Path) -> None:
    w, clock, ranks = watch(tmp_path, nprocs=2, unseen_s=10)
    ranks[100] = 0
    assert w.poll(lambda: [100]) is None
    clock.now += 9
    assert w.poll(lambda: [100]) is None
    clock.now += 2  # rank 1 died between two polls, long before rank 0 could have finished its start
    assert w.poll(lambda: [100]) is None  # the grace
    clock.now += 2
    line = w.poll(lambda: [100])
    assert line is not None and f"rank 1 on host {HERE}" in line
    (tmp_path / "x").mkdir()
    elsewhere, clock2, ranks2 = watch(tmp_path / "x", nprocs=2, all_local=False)
    ranks2[100] = 0
    elsewhere.poll(lambda: [100])
    clock2.now += 60
    assert elsewhere.poll(lambda: [100]) is None, "on several hosts an unseen rank may run elsewhere"


def test_an_exception_speaks_for_itself(tmp_path: Path) -> None:
    w, clock, ranks = watch(tmp_path)
    ranks.update({100: 0, 101: 1})
    w.poll(lambda: [100, 101])
    mark(tmp_path, "init.0", "hostA 100")
    mark(tmp_path, "raised.1", "ConfigurationError\nConfigurationError: recover.x\n")
    clock.now += 10
    assert w.poll(lambda: [100]) is None


def test_the_survivors_lost_at_start_markers_are_said_once_from_the_launcher(tmp_path: Path) -> None:
    w, _clock, ranks = watch(tmp_path)
    ranks.update({100: 0, 101: 1, 102: 2})
    w.poll(lambda: [100, 101, 102])
    mark(tmp_path, "init.0", "hostA 100")
    mark(tmp_path, "exited.0", "lost at start: rank(s) [1] died before the communicator came up")
    line = w.poll(lambda: [100, 102])
    assert line is not None and f"rank 1 on host {HERE}, which died after MPI started" in line


def test_ranks_elsewhere_get_a_bound_from_the_first_rank_start(tmp_path: Path) -> None:
    w, clock, _ranks = watch(tmp_path, nprocs=3, all_local=False)
    mark(tmp_path, "init.0", "hostA 1", mtime=clock.now)
    mark(tmp_path, "init.2", "hostC 1", mtime=clock.now)
    mark(tmp_path, "started.0")
    clock.now += 59
    assert w.poll(list) is None
    clock.now += 2
    line = w.poll(list)
    assert line is not None
    assert "first step: rank 1 (host unknown: it never reached the strategy's start), with no communicator 60 s" in line
    # Every rank reached the strategy's start, one never got its communicator: that one is named.
    (tmp_path / "all").mkdir()
    w, clock, _ = watch(tmp_path / "all", nprocs=2, all_local=False)
    mark(tmp_path / "all", "init.0", "hostA 1", mtime=clock.now)
    mark(tmp_path / "all", "init.1", "hostB 1", mtime=clock.now)
    mark(tmp_path / "all", "started.0")
    clock.now += 61
    line = w.poll(list)
    assert line is not None and "first step: rank 1 on host hostB, with no communicator" in line
    assert "LIGHTNING_RECOVER_START_TIMEOUT=SECONDS" in line


def test_no_bound_when_the_status_directory_is_this_hosts_alone(tmp_path: Path) -> None:
    # Ranks on other hosts whose markers never reach this directory (not a shared --status-dir): their
    # start cannot be judged, so a healthy job is never ended for it.
    w, clock, _ = watch(tmp_path, nprocs=4, all_local=False)
    mark(tmp_path, "init.0", f"{HERE} 1", mtime=clock.now)
    mark(tmp_path, "init.1", f"{HERE} 2", mtime=clock.now)
    mark(tmp_path, "started.0")
    mark(tmp_path, "started.1")
    clock.now += 10_000
    assert w.poll(list) is None
    assert w.over, "nothing left to watch: the ranks here are up, the bound cannot apply"


def test_the_watch_stops_once_every_rank_started(tmp_path: Path) -> None:
    w, _clock, _ranks = watch(tmp_path, nprocs=2)
    for r in (0, 1):
        mark(tmp_path, f"init.{r}", "h 1")
        mark(tmp_path, f"started.{r}")
    calls: list[int] = []
    assert w.poll(lambda: calls.append(1) or []) is None and w.over and not calls


def test_the_last_line_names_the_host_of_a_rank_seen_here(tmp_path: Path) -> None:
    # mpiexec ended before the watch's next poll: the launcher's last line comes from the markers, and
    # the lost rank, which left no init marker, is named with this host because the watch saw it here.
    w, _, ranks = watch(tmp_path, nprocs=2)
    ranks.update({100: 0, 101: 1})
    w.poll(lambda: [100, 101])
    mark(tmp_path, "init.0", "hostA 1")
    mark(tmp_path, "exited.0", "lost at start: rank(s) [1] died before the communicator came up")
    _, words = final_words(w.local_hosts(JobMarkers.read(str(tmp_path))), 2, 0)
    assert words is not None and f"rank 1 on host {HERE}" in words


def test_final_words_for_a_start_lost_job(tmp_path: Path) -> None:
    mark(tmp_path, "init.0", "hostA 1")
    mark(tmp_path, "init.1", "hostB 2")
    mark(tmp_path, "exited.0", "lost at start: rank(s) [1] died before the communicator came up")
    status, words = final_words(JobMarkers.read(str(tmp_path)), 2, 0)
    assert status == START_LOST_STATUS == RUNNER_STATUS == 69
    assert words is not None and "rank 1 on host hostB" in words
    assert final_words(JobMarkers.read(str(tmp_path)), 2, RUNNER_STATUS) == (RUNNER_STATUS, None), "the watch already said it"


def test_start_timeout_and_rank_of(monkeypatch: pytest.MonkeyPatch) -> None:
    assert start_timeout({}) == DEFAULT_START_TIMEOUT_S and start_timeout({"LIGHTNING_RECOVER_START_TIMEOUT": "30"}) == 30
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(ValueError, match=f"LIGHTNING_RECOVER_START_TIMEOUT='{bad}' must be a positive number of seconds"):
            start_timeout({"LIGHTNING_RECOVER_START_TIMEOUT": bad})
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while rank_of(child.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # /proc/PID/environ is the new program's once the child has exec'd
        assert rank_of(child.pid) == 5 and rank_of(os.getpid()) is None  # this process's environ is its start's
    finally:
        child.kill()
        child.wait()


def test_the_supervisor_relaunches_a_job_lost_at_start() -> None:
    from lightning_recover.cli.supervision import Host, Outcome, SupervisionPolicy, classify, decide, first_plan

    policy = SupervisionPolicy(max_relaunches=1)
    plan = first_plan(policy, (Host("a", 2),), 2)
    lost = Outcome(2, RUNNER_STATUS, started=frozenset({0}), exited=frozenset({0}), lost_at_start=True)
    assert classify(lost) == "lost_at_start"
    first = decide(policy, plan, lost, relaunches_done=0, target_nprocs=2)
    assert first.action == "relaunch" and "lost while the job started" in first.reason
    assert decide(policy, plan, lost, relaunches_done=1, target_nprocs=2).action == "give_up", "bounded like any relaunch"
