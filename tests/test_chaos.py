"""The chaos campaign (benchmarks/chaos.py): its draws are sane, and a short campaign of real
runs has no violation."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos import JOIN_PHASES, PHASES, draw_run  # benchmarks/chaos.py (tests/conftest.py puts benchmarks/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 6))
def test_draws_lose_at_most_w_minus_one_whole_replicas(seed: int, steps: int) -> None:
    run = draw_run(0, random.Random(seed), steps)
    replicas = [f["rank"] // run.shards for f in run.faults]
    assert 1 <= len(replicas) <= run.replicas - 1
    assert len(set(replicas)) == len(replicas), "one fault per victim replica"
    for f in run.faults:
        assert 0 <= f["rank"] < run.world and 0 <= f["step"] < steps
        assert f["phase"] in PHASES and f["kind"] in ("kill", "hang")


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_join_draws_add_faults_only_on_the_victims_replacements(seed: int) -> None:
    plain, joins = draw_run(0, random.Random(seed), 40), draw_run(0, random.Random(seed), 40, joins=True)
    assert joins.rejoin and not plain.rejoin
    n = len(plain.faults)
    assert joins.faults[:n] == plain.faults, "the rest of a seed's draw is unchanged"
    victims = {f["rank"] // plain.shards for f in plain.faults}
    for f in joins.faults[n:]:
        assert f["phase"] in JOIN_PHASES and f["kind"] == "kill" and f["step"] in (1, 2)
        assert f["rank"] // joins.shards in victims, "only a lost replica has a replacement to kill"


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 6))
def test_stuck_faults_replace_only_some_hangs(seed: int, steps: int) -> None:
    plain, mixed = draw_run(0, random.Random(seed), steps), draw_run(0, random.Random(seed), steps, stuck=True)
    assert len(plain.faults) == len(mixed.faults)
    for a, b in zip(plain.faults, mixed.faults):
        assert {**a, "kind": None} == {**b, "kind": None}  # same victim, step, phase, timing
        assert b["kind"] == a["kind"] or (a["kind"], b["kind"]) == ("hang", "stuck")


@pytest.mark.mpi
def test_short_campaign_has_no_violation(tmp_path: Path) -> None:
    # With --stuck, seed 1043 draws 3 SIGSTOPs and 1 rank spinning in compute among 20 faults in 7
    # runs over 4 topologies (2x2, 4x1, 4x1 with a spare, 5x1 with a spare).
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--runs", "7", "--seed", "1043", "--steps", "2", "--stuck",
        "--out", str(tmp_path),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    assert lines[-1].startswith("chaos: OK: 7 runs, 0 with violations")
    assert sum(" stuck -> " in line or " stuck, " in line for line in lines) == 1, "the draw should hold one stuck fault"
    table = dict(line.split("  ", 1) for line in lines if not line.startswith(("[", "chaos:")))
    table = {k.strip(): v.strip() for k, v in table.items()}
    assert table["violations"] == "0" and table["hangs"] == "0"
    assert int(table["recovered"]) == int(table["faults injected (fired)"]) > 0
    assert table["silent-fault detection"].startswith("n="), table
    # Every rank checked for silent data corruption after every step: no false positive.
    assert int(table["corruption checks (all ranks)"]) > 0 and table["sdc false positives"] == "0", table
