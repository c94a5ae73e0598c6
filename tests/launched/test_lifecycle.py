"""Process lifecycle on real processes: import hygiene, the pid-safe kill, the gate, the crash hook, markers."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_recover.cli.job_status import JobMarkers
from lightning_recover.runtime import lifecycle
from lightning_recover.runtime.markers import ENV_STATUS_DIR

ROOT = Path(__file__).resolve().parents[2]

# Imports the heavy third-party modules first, so only what *our* imports do is judged; then
# each of our modules in turn, recording every process-wide change it made.
HYGIENE = r"""
import atexit, inspect, json, signal, sys
import numpy, torch, torch.distributed, lightning.pytorch, mpi4py

registered = []
_register = atexit.register
def spy(fn, *args, **kwargs):
    registered.append(f"{getattr(fn, '__qualname__', fn)!s} (registered from {inspect.stack()[1].filename})")
    return _register(fn, *args, **kwargs)
atexit.register = spy
_signal = signal.signal
def signal_spy(sig, handler):
    registered.append(f"signal handler for {sig!s} (set from {inspect.stack()[1].filename})")
    return _signal(sig, handler)
signal.signal = signal_spy

SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]
def state():
    return {
        "excepthook": repr(sys.excepthook),
        "signals": {str(int(s)): repr(signal.getsignal(s)) for s in SIGNALS},
        "mpi4py.rc": {k: repr(getattr(mpi4py.rc, k)) for k in dir(mpi4py.rc) if not k.startswith("_")},
        "atexit callbacks": atexit._ncallbacks(),  # counts C-level registrations too (CPython)
    }

findings = {}
for name in ["lightning_recover", "lightning_recover.runtime.lifecycle", "lightning_recover.runtime.watchdog",
             "lightning_recover.comm.communicator", "lightning_recover.strategies"]:
    before = state()
    del registered[:]
    try:
        __import__(name)
    except Exception as exc:
        findings[name] = [f"import failed: {type(exc).__name__}: {exc}"]
        continue
    after = state()
    changed = [f"{key}: {before[key]!r} -> {after[key]!r}" for key in before if before[key] != after[key]]
    if "mpi4py.MPI" in sys.modules:
        changed.append("mpi4py.MPI was imported (MPI initialized)")
    findings[name] = changed + list(registered)
print(json.dumps(findings))
"""


def test_importing_the_package_changes_no_process_wide_state() -> None:
    proc = subprocess.run([sys.executable, "-c", HYGIENE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    findings = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(findings) == 5
    assert {name: f for name, f in findings.items() if f} == {}, "importing must not touch MPI, the excepthook, signals or atexit"


# ---------------------------------------------------------------------- prepare_mpi
PREPARE = r"""
import sys, mpi4py
from lightning_recover.runtime import lifecycle
first = lifecycle.prepare_mpi()
from mpi4py import MPI
print(first, mpi4py.rc.finalize, lifecycle.prepare_mpi(), MPI.Is_initialized())
"""


def test_prepare_mpi_turns_finalize_off_only_before_mpi_starts() -> None:
    proc = subprocess.run([sys.executable, "-c", PREPARE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Took effect before the import; a second call after MPI started says it cannot.
    assert proc.stdout.split() == ["True", "False", "False", "True"]


# ---------------------------------------------------------------------- kill_process
def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_kill_process_kills_the_process_that_started_then(capfd: pytest.CaptureFixture[str]) -> None:
    child = _sleeper()
    try:
        start = lifecycle.process_start_time(child.pid)
        assert start is not None and start.isdigit()
        assert lifecycle.kill_process(child.pid, start, "hung for 9.0s", by="watchdog on rank 0", target="rank 2") is True
        assert child.wait(timeout=10) == -signal.SIGKILL
        err = capfd.readouterr().err
        assert f"[lightning-recover] watchdog on rank 0: killing rank 2 (pid {child.pid}): hung for 9.0s" in err
        # Reaped: the pid names no process any more.
        assert lifecycle.process_start_time(child.pid) is None
        assert lifecycle.kill_process(child.pid, start, "again", by="test") is False
    finally:
        child.kill()
        child.wait()


def test_kill_process_refuses_a_pid_with_another_start_time() -> None:
    child = _sleeper()
    try:
        start = lifecycle.process_start_time(child.pid)
        assert start is not None
        # The pid now belongs to a process started at another time (pid reuse), or we never knew.
        other = str(int(start) - 1)
        assert lifecycle.kill_process(child.pid, other, "reused pid", by="test") is False
        assert lifecycle.kill_process(child.pid, None, "unknown start", by="test") is False
        time.sleep(0.2)
        assert child.poll() is None, "a process that is not the one we meant must survive"
    finally:
        child.kill()
        child.wait()


def test_kill_process_leaves_an_already_dead_process_alone(capfd: pytest.CaptureFixture[str]) -> None:
    child = _sleeper()
    start = lifecycle.process_start_time(child.pid)
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(child.pid) == "Z"
    # Dead but not yet reaped (what a fence sees for a rank that really died): nothing to do, nothing printed.
    assert lifecycle.kill_process(child.pid, start, "declared dead", by="rank 0", target="rank 1") is False
    assert "killing" not in capfd.readouterr().err
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_kill_process_refuses_its_own_process() -> None:
    with pytest.raises(ValueError, match=rf"asked to kill its own process \(pid {os.getpid()}\)"):
        lifecycle.kill_process(os.getpid(), lifecycle.process_start_time(os.getpid()), "oops", by="test")


# ---------------------------------------------------------------------- gate and crash hook
GATE = r"""
import signal
from lightning_recover.runtime import lifecycle
signal.signal(lifecycle.GATE_SIGNAL, lambda *_: print("handler ran: the gate must not be catchable", flush=True))
lifecycle.gate_exit(3, "replica 1 lost rank(s) [2]")
print("returned from gate_exit", flush=True)
"""


def test_gate_exit_dies_by_its_signal_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-c", GATE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGUSR1, (proc.returncode, proc.stderr)
    assert lifecycle.GATE_SIGNAL == signal.SIGUSR1 and lifecycle.GATE_EXIT_CODE == 138  # what a shell reports
    assert proc.stdout == "", "neither an installed handler nor the code after gate_exit may run"
    assert proc.stderr.strip() == (
        "[lightning-recover] rank 3: replica-consistency gate: replica 1 lost rank(s) [2]; leaving with SIGUSR1 (status 138)"
    )


def test_gate_exit_from_a_helper_thread_dies_by_its_signal() -> None:
    # The overlapped reduction runs on a helper thread and may reach the gate there.
    helper = GATE.replace('lifecycle.gate_exit(3, "replica 1 lost rank(s) [2]")', (
        "import threading, time\n"
        "t = threading.Thread(target=lifecycle.gate_exit, args=(3, 'replica 1 lost rank(s) [2]'))\n"
        "t.start(); t.join(); time.sleep(2)"
    ))
    proc = subprocess.run([sys.executable, "-c", helper], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGUSR1, (proc.returncode, proc.stderr)
    assert proc.stdout == "", "neither an installed handler nor the code after gate_exit may run"
    assert "replica-consistency gate" in proc.stderr and "Error" not in proc.stderr, proc.stderr


QUORUM = r"""
import signal, sys, threading, time
from lightning_recover.runtime import lifecycle
signal.signal(signal.SIGUSR2, lambda *a: print("handler ran"))
t = threading.Thread(target=lifecycle.quorum_exit, args=(2, "1 surviving replica(s) tie with 1"))
t.start(); t.join(); time.sleep(2)
print("still running")
"""


def test_quorum_exit_leaves_by_its_signal_from_any_thread_with_its_marker(tmp_path: Path) -> None:
    # By a signal, never a plain non-zero exit (Open MPI would abort the whole job, the side
    # that may go on included); from the repair's timer thread too.
    env = {**os.environ, ENV_STATUS_DIR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", QUORUM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGUSR2 and lifecycle.QUORUM_EXIT_CODE == 140, (proc.returncode, proc.stderr)
    assert proc.stdout == "", "neither an installed handler nor the code after quorum_exit may run"
    assert proc.stderr.strip().startswith("[lightning-recover] rank 2: no quorum: 1 surviving replica(s) tie with 1; ")
    assert "--supervise" in proc.stderr
    assert (tmp_path / "exited.2").read_text() == "no quorum: 1 surviving replica(s) tie with 1"
    assert JobMarkers.read(str(tmp_path)).no_quorum == {2}


def test_gate_status_through_a_shell() -> None:
    proc = subprocess.run(["sh", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(GATE)}; echo status=$?"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == f"status={lifecycle.GATE_EXIT_CODE}"


CRASH = r"""
from lightning_recover.runtime import lifecycle
lifecycle.install_crash_hook()
lifecycle.install_crash_hook()  # idempotent: one traceback, one line
def train():
    raise RuntimeError("boom in step 7")
train()
"""


def test_crash_hook_prints_the_traceback_then_dies_by_sigkill() -> None:
    proc = subprocess.run([sys.executable, "-c", CRASH], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    err = proc.stderr
    assert err.count("Traceback (most recent call last):") == 1
    assert "in train" in err and "RuntimeError: boom in step 7" in err
    line = "[lightning-recover] uncaught RuntimeError: this rank leaves by SIGKILL"
    assert err.count(line) == 1
    assert err.index("RuntimeError: boom in step 7") < err.index(line), "the traceback comes first"


# torch's init_process_group wraps sys.excepthook and buffers stderr while the inner hook runs;
# the crash hook kills the process inside that window, so it must write to the real stderr.
UNDER_TORCH = r"""
import sys
import torch.distributed as dist
from lightning_recover.runtime import lifecycle

def init():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

order = sys.argv[1]
if order == "hook-then-init":
    lifecycle.install_crash_hook(0)
    init()
elif order == "init-then-hook":
    init()
    lifecycle.install_crash_hook(0)
else:  # torch wraps twice around ours (a process group re-created, e.g. for trainer.validate)
    lifecycle.install_crash_hook(0)
    init()
    dist.destroy_process_group()
    init()
def training_step():
    raise ValueError("user bug 42")
training_step()
"""


@pytest.mark.parametrize("order", ["hook-then-init", "init-then-hook", "wrapped-twice"])
def test_crash_hook_traceback_survives_torchs_excepthook_wrapper(tmp_path: Path, order: str) -> None:
    env = {**os.environ, ENV_STATUS_DIR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", UNDER_TORCH, order], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    err = proc.stderr
    assert "Traceback (most recent call last):" in err and "in training_step" in err, err
    assert "ValueError: user bug 42" in err
    assert err.index("ValueError: user bug 42") < err.index("[lightning-recover] uncaught ValueError: this rank leaves by SIGKILL (rank 0)")
    assert (tmp_path / "raised.0").read_text() == "ValueError\nValueError: user bug 42\n"


SAME_BUG = r"""
import sys
from lightning_recover.runtime import lifecycle
lifecycle.install_crash_hook(int(sys.argv[1]))
def training_step():
    raise ValueError("user bug 42")
training_step()
"""


def test_ranks_sharing_the_status_directory_print_one_traceback_once(tmp_path: Path) -> None:
    env = {**os.environ, ENV_STATUS_DIR: str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", SAME_BUG, str(r)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60) for r in (0, 1)]
    assert [p.returncode for p in runs] == [-signal.SIGKILL, -signal.SIGKILL]
    first, second = runs[0].stderr, runs[1].stderr
    assert first.count("Traceback (most recent call last):") == 1 and "ValueError: user bug 42" in first
    assert first.strip().splitlines()[-1] == "[lightning-recover] uncaught ValueError: this rank leaves by SIGKILL (rank 0)"
    assert "Traceback" not in second, "the same traceback is printed once per host"
    assert second.strip() == "[lightning-recover] uncaught ValueError: this rank leaves by SIGKILL (rank 1; same traceback as another rank printed)"
    assert {m for m in os.listdir(tmp_path) if m.startswith("raised.")} == {"raised.0", "raised.1"}
    # A different error is a different traceback: printed in full again.
    other = subprocess.run(
        [sys.executable, "-c", SAME_BUG.replace("user bug 42", "user bug 43"), "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert "ValueError: user bug 43" in other.stderr and "Traceback (most recent call last):" in other.stderr


# ---------------------------------------------------------------------- markers and end of job
START = r"""
import sys
from lightning_recover.runtime import lifecycle
rank, world, then = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
hook = sys.excepthook
lifecycle.start_rank(rank, world)
lifecycle.start_rank(rank, world)  # a second setup of the same rank changes nothing
print("crash hook" if sys.excepthook is not hook else "python's hook", flush=True)
if then == "raise":
    raise RuntimeError("crash")
if then == "sigterm":  # what Lightning does with a SIGTERM during fit: SystemExit, status 0
    import signal
    lifecycle.terminated_by(signal.SIGTERM)
    sys.exit()
"""


def _start(tmp_path: Path, rank: int, world: int, then: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    status = tmp_path / f"status-{rank}-{world}-{then}"
    status.mkdir()
    env = {**os.environ, ENV_STATUS_DIR: str(status)}
    proc = subprocess.run([sys.executable, "-c", START, str(rank), str(world), then], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return proc, sorted(os.listdir(status))


def test_start_rank_marks_started_and_ok_at_a_normal_exit(tmp_path: Path) -> None:
    proc, markers = _start(tmp_path, 5, 4, "return")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "crash hook"
    assert markers == ["ok.5", "started.5"]


def test_a_rank_ended_by_sigterm_leaves_as_killed_by_it_never_ok(tmp_path: Path) -> None:
    # mpiexec aborting the job (or a scheduler) sends SIGTERM; Lightning turns it into a clean
    # SystemExit. The launcher must read the rank as killed, not as one that finished.
    proc, markers = _start(tmp_path, 1, 4, "sigterm")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert markers == ["started.1"]


EPIPE = r"""
import sys, time
from lightning_recover.runtime import lifecycle
lifecycle.start_rank(1, 4)
time.sleep(0.5)  # meanwhile the reader of our output goes (mpiexec aborting the job)
for _ in range(100):
    print("x" * 1000, flush=True)
"""


def test_a_rank_whose_launcher_is_gone_leaves_as_killed_not_as_a_broken_program(tmp_path: Path) -> None:
    # Printing into the pipe of an mpiexec that aborted the job fails with EPIPE: that is the job
    # ending, and a "raised" marker would make a supervisor give up instead of relaunching.
    env = {**os.environ, ENV_STATUS_DIR: str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", EPIPE], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    proc.stderr.close()
    assert proc.wait(timeout=60) == -lifecycle.CRASH_SIGNAL
    assert sorted(os.listdir(tmp_path)) == ["started.1"]


def test_crashed_rank_leaves_started_and_raised_but_never_ok(tmp_path: Path) -> None:
    # What the launcher reads as "this rank did not survive, because the program raised".
    proc, markers = _start(tmp_path, 2, 4, "raise")
    assert proc.returncode == -signal.SIGKILL
    assert [m for m in markers if not m.startswith(lifecycle.PRINTED_PREFIX)] == ["raised.2", "started.2"]
    assert (tmp_path / "status-2-4-raise" / "raised.2").read_text() == "RuntimeError\nRuntimeError: crash\n"
    assert "RuntimeError: crash" in proc.stderr and "(rank 2)" in proc.stderr


def test_single_process_keeps_pythons_exit_status(tmp_path: Path) -> None:
    # No peers to protect: an exception ends the process the usual way (status 1), which
    # is what the launcher and mpiexec report for a one-rank job.
    proc, markers = _start(tmp_path, 0, 1, "raise")
    assert proc.stdout.strip() == "python's hook"
    assert proc.returncode == 1 and "RuntimeError: crash" in proc.stderr
    assert "started.0" in markers
    # The exit handler tells the launcher it raised: never "ok".
    assert markers == ["raised.0", "started.0"]


END = r"""
import sys
from lightning_recover.runtime import lifecycle

class Comm:  # what end_job needs from the communicator, logging the order of calls
    rank = 1
    is_leader = True  # the last world's leader: it names that world's members in its done marker
    members = (1, 3)
    def agree(self, flag):
        print(f"agree({flag})", flush=True)
        return True
    def free(self):
        print("free", flush=True)

code = None if sys.argv[1] == "none" else int(sys.argv[1])
lifecycle.end_job(Comm(), code)
print("returned", flush=True)
"""


@pytest.mark.parametrize(("code", "marker"), [("0", "ok.1"), ("3", "exited.1")])
def test_end_job_agrees_frees_marks_and_exits(tmp_path: Path, code: str, marker: str) -> None:
    env = {**os.environ, ENV_STATUS_DIR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", END, code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == int(code)
    assert proc.stdout.split() == ["agree(True)", "free"], "agree with the survivors first, then free, then leave at once"
    assert sorted(os.listdir(tmp_path)) == sorted(["done.1", marker])
    assert (tmp_path / "done.1").read_text() == "1,3"


def test_end_job_without_exit_code_returns(tmp_path: Path) -> None:
    env = {**os.environ, ENV_STATUS_DIR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", END, "none"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.split() == ["agree(True)", "free", "returned"]
    assert os.listdir(tmp_path) == ["done.1"], "without start_rank nothing registered an ok marker"


def test_mark_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_STATUS_DIR, str(tmp_path))
    lifecycle.mark_status("exited", 7)
    assert os.listdir(tmp_path) == ["exited.7"]
    with pytest.raises(ValueError, match="status marker must be one of init, started, ok, exited, raised, done, got 'finished'"):
        lifecycle.mark_status("finished", 7)  # type: ignore[arg-type]
    monkeypatch.setenv(ENV_STATUS_DIR, str(tmp_path / "gone"))
    lifecycle.mark_status("ok", 7)  # outside a launched job (or after cleanup): silently nothing
    assert os.listdir(tmp_path) == ["exited.7"]


# ---------------------------------------------------------------------- the end of a script
EXIT = r"""
import atexit, gc, sys
from lightning_recover.runtime import lifecycle

def after_everything():  # registered first, so it runs after lifecycle's exit handler
    print(f"gc enabled={gc.isenabled()} frozen={gc.get_freeze_count() > 0}", flush=True)
atexit.register(after_everything)

class Comm:
    rank = 1
    is_leader = False
    def agree(self, flag):
        print("agree", flush=True)
        return True
    def free(self):
        print("free", flush=True)

comm = Comm()
def end_of_job():  # what the strategy registers: its shutdown(), a no-op once the job ended
    print(f"end_of_job ended={lifecycle.job_ended(comm)}", flush=True)
    if not lifecycle.job_ended(comm):
        lifecycle.end_job(comm)

lifecycle.start_rank(1, int(sys.argv[2]), end_of_job)
print("script ends", flush=True)
then = sys.argv[1]
if then == "shutdown":
    lifecycle.end_job(comm)
elif then == "exit3":
    sys.exit(3)
"""


@pytest.mark.parametrize(
    ("then", "code", "lines"),
    [
        # The script just ends: the end of job runs at exit, once, before the ok marker.
        ("end", 0, ["script ends", "end_of_job ended=False", "agree", "free", "gc enabled=False frozen=True"]),
        # It ended the job itself: the exit handler finds it done.
        ("shutdown", 0, ["script ends", "agree", "free", "end_of_job ended=True", "gc enabled=False frozen=True"]),
        # Python's own exit status stays.
        ("exit3", 3, ["script ends", "end_of_job ended=False", "agree", "free", "gc enabled=False frozen=True"]),
    ],
)
def test_a_script_that_ends_runs_the_end_of_job_once_and_keeps_its_status(tmp_path: Path, then: str, code: int, lines: list[str]) -> None:
    env = {**os.environ, ENV_STATUS_DIR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", EXIT, then, "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.split("\n")[:-1] == lines
    assert sorted(os.listdir(tmp_path)) == ["ok.1", "started.1"]


def test_a_failing_end_of_job_is_reported_as_raised_never_ok(tmp_path: Path) -> None:
    failing = EXIT.replace('    print(f"end_of_job ended', '    raise RuntimeError("agreement failed")\n    print(f"end_of_job ended')
    env = {**os.environ, ENV_STATUS_DIR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", failing, "end", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "RuntimeError: agreement failed" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["raised.1", "started.1"]


def test_launched_and_the_single_replica_warning(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", ENV_STATUS_DIR):
        monkeypatch.delenv(var, raising=False)
    assert lifecycle.launched() is False
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert lifecycle.launched() is True
    monkeypatch.setattr(lifecycle, "_warned_single", False)
    monkeypatch.setattr(sys, "argv", ["/home/me/train.py", "--lr", "1"])
    lifecycle.warn_single_replica()
    lifecycle.warn_single_replica()  # once per process
    err = capsys.readouterr().err
    assert err == (
        "[lightning-recover] warning: not started by a launcher, so this process trains as a single replica with no "
        "fault tolerance; to run N replicas: lightning-recover launch -n N -- python train.py\n"
    )
