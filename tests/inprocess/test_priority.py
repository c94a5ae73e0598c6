"""A warm standby's CPU priority (lightning_recover.runtime.priority), on real processes and threads:
idle while warming, back to normal when seated, nice +10 after the fallback, promoted by its leader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from lightning_recover.runtime import priority

#: Runs in its own process (the test's own threads must keep their priority): reports each phase.
CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    from lightning_recover.runtime import priority

    def policies():
        out = {}
        for t in os.listdir("/proc/self/task"):
            try:
                out[t] = [os.sched_getscheduler(int(t)), os.getpriority(os.PRIO_PROCESS, int(t))]
            except OSError:
                pass
        return out

    base = os.getpriority(os.PRIO_PROCESS, 0)
    fallback = float(sys.argv[1])
    restore = priority.yield_while_warming(fallback)
    started = threading.Event()
    threading.Thread(target=lambda: (started.set(), time.sleep(30)), daemon=True).start()  # born while idle
    started.wait()
    watcher = [t.native_id for t in threading.enumerate() if t.name == "lightning-recover-standby-priority"]
    print(json.dumps({"phase": "warming", "base": base, "watcher": watcher, "threads": policies()}), flush=True)
    if fallback < 1:
        time.sleep(fallback + 0.5)
        print(json.dumps({"phase": "fallen back", "threads": policies()}), flush=True)
    restore()
    print(json.dumps({"phase": "restored", "threads": policies()}), flush=True)
""")


def _run_child(fallback_s: float) -> dict[str, dict]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(fallback_s)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return {d["phase"]: d for d in map(json.loads, out.stdout.splitlines())}


def test_a_warming_standby_runs_idle_and_is_restored_when_seated() -> None:
    phases = _run_child(fallback_s=60)
    warming, base = phases["warming"], phases["warming"]["base"]
    (watcher,) = warming["watcher"]
    others = {t: p for t, p in warming["threads"].items() if int(t) != watcher}
    assert len(others) >= 2, warming  # the main thread and the one started while idle
    assert all(policy == os.SCHED_IDLE for policy, _ in others.values()), f"not every thread idles: {warming}"
    # The watcher must wake on time on a host with no idle core: it stays at normal priority.
    assert warming["threads"][str(watcher)][0] == os.SCHED_OTHER, warming
    restored = phases["restored"]["threads"]
    assert all(p == [os.SCHED_OTHER, base] for p in restored.values()), f"a thread left behind at seat time: {restored}"


def test_a_standby_still_warming_after_the_fallback_gets_a_small_share() -> None:
    phases = _run_child(fallback_s=0.2)
    base = phases["warming"]["base"]
    fallen = phases["fallen back"]["threads"]
    assert all(p == [os.SCHED_OTHER, min(19, base + priority.STANDBY_NICE)] for p in fallen.values()), fallen
    assert all(p == [os.SCHED_OTHER, base] for p in phases["restored"]["threads"].values()), phases["restored"]


def test_the_leader_promotes_a_standby_it_needs_before_it_is_warm() -> None:
    idle = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, threading, time
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, 10)
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout is not None and idle.stdout.readline().strip() == "ready"
        tids = [int(t) for t in os.listdir(f"/proc/{idle.pid}/task")]
        assert len(tids) == 2 and all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids)
        assert priority.promote(idle.pid)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert all(os.sched_getscheduler(t) == os.SCHED_OTHER for t in tids)
        assert all(os.getpriority(os.PRIO_PROCESS, t) == mine for t in tids)
    finally:
        idle.send_signal(signal.SIGKILL)
        idle.wait()
    deadline = time.time() + 5
    while os.path.exists(f"/proc/{idle.pid}") and time.time() < deadline:
        time.sleep(0.05)
    assert not priority.promote(idle.pid), "a process that is gone cannot be promoted"
