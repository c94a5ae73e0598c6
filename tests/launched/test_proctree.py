"""benchmarks/proctree.py: a launch's whole tree is ended by pid, also what left its group or session."""

from __future__ import annotations

import os
import sys
import time



from benchmarks.proctree import ProcessTree, _alive  # noqa: E402

# The root starts one child that leaves its process group (as PRRTE does with every rank) and
# ignores SIGTERM, and one that leaves its session (as torchrun does with every worker), prints
# their pids, lingers so the tree is seen, then exits and orphans them.
ROOT = r"""
import os, subprocess, sys, time
a = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300"], preexec_fn=lambda: os.setpgid(0, 0))
b = subprocess.Popen(["sleep", "300"], start_new_session=True)
print(a.pid, b.pid, flush=True)
time.sleep(1.0)
"""


def test_end_kills_orphans_outside_the_group_and_the_session(capsys) -> None:  # type: ignore[no-untyped-def]
    import subprocess

    with ProcessTree([sys.executable, "-c", ROOT], "test", stdout=subprocess.PIPE) as tree:
        line = tree.proc.stdout.readline().split()  # type: ignore[union-attr]
        a, b = int(line[0]), int(line[1])
        assert tree.wait(timeout=30) == 0
        assert _alive(a, None) and _alive(b, None), "both children outlived the root"
        ended = tree.end()
    assert {a, b} <= {int(e.split()[0]) for e in ended}  # (and the sh's own sleep)
    deadline = time.monotonic() + 5
    while (_alive(a, None) or _alive(b, None)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(a, None) and not _alive(b, None)
    err = capsys.readouterr().err
    assert f"[cleanup] test: {len(ended)} process(es) still alive after its launcher exited" in err


def test_end_on_a_clean_exit_reports_nothing(capsys) -> None:  # type: ignore[no-untyped-def]
    with ProcessTree([sys.executable, "-c", "pass"], "clean") as tree:
        assert tree.wait(timeout=30) == 0
    assert tree.ended == [] and "[cleanup]" not in capsys.readouterr().err
    assert os.getpid() not in tree.leftovers()
