"""The control plane's MPI calls per rank: constant per steady step, at most linear per repair (issue 33).

``benchmarks/control_plane.py`` at 4, 8 and 16 ranks (4-64 is the benchmark's default run):
real ``mpiexec --with-ft ulfm`` jobs of the step engine, every MPI call of every communicator
counted on every rank (``benchmarks/mpi_counter.py``), one rank SIGKILLed in a step's reduction.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest



from benchmarks import control_plane  # noqa: E402
from benchmarks import control_plane_model  # noqa: E402

#: The rank script's MLP (16 -> 32 -> 2): its fp32 gradients, in bytes.
GRAD_BYTES = (16 * 32 + 32 + 32 * 2 + 2) * 4


def test_payload_reads_mpi4py_buffer_specs() -> None:
    import numpy as np
    from mpi4py import MPI

    from benchmarks.mpi_counter import Counter, payload

    buf = np.zeros(10, dtype=np.float64)
    assert payload(buf) == 80 and payload([buf, MPI.DOUBLE]) == 80 and payload(MPI.IN_PLACE) == 0
    c = Counter()
    before = c.snapshot()
    c.note("Iallreduce", 80, 80)
    c.note("Ack_failed")  # local: counted apart
    assert c.since(before) == {"Iallreduce": [1, 80, 80]} and c.local == {"Ack_failed": 1}


def test_model_grows_logarithmically_and_names_its_sources() -> None:
    m = control_plane_model
    # log2 form: 64 -> 4096 ranks is 6 -> 12 tree levels, twice the agreement; 10^5 ranks stays under 1 ms.
    assert m.agree_seconds(4096) == pytest.approx(2 * m.agree_seconds(64))
    assert m.agree_seconds(100_000) < 1e-3 and m.agree_seconds(1024, failed=2) == pytest.approx(3 * m.agree_seconds(1024))
    assert m.steady_step_bytes(4, GRAD_BYTES) == m.steady_step_bytes(100_000, GRAD_BYTES) == GRAD_BYTES + 44
    assert m.repair_bytes(2048) == 2 * m.repair_bytes(1024) - m.AGREE_BYTES
    assert m.fault_pause_seconds(100_000, node_lost=True) > 10.0 > m.fault_pause_seconds(100_000)
    assert {"agreement", "revoke", "detection", "hop"} <= set(m.SOURCES)


@pytest.mark.mpi
def test_steady_step_calls_and_bytes_are_constant_and_repair_at_most_linear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "control_plane.json"
    rc = control_plane.main(["--ranks", "4", "8", "16", "--steps", "2", "--out", str(out_json), "--workdir", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out_json.read_text())
    points = res["points"]
    assert [p["ranks"] for p in points] == [4, 8, 16] and not res["failed"]
    # Every rank, every steady step, every size (and the step after the repair): the same calls and bytes.
    steady = points[0]["steady_tally"]
    assert all(p["steady_tally"] == steady for p in points) and res["steady_constant"]
    buckets = points[0]["buckets"]
    assert buckets >= 2  # several buckets, so a per-bucket call would show
    # The buckets and the 40-byte header, then the 4-byte agreement: nothing else, on any size.
    assert steady == {"Iallreduce": [buckets + 1, GRAD_BYTES + 40, GRAD_BYTES + 40], "Iagree": [1, 4, 4]}, steady
    for p in points:
        repair = p["repair_tally_leader"]
        # One shrink, one agreement, the shard split; the world is the shrunk communicator (no second split).
        assert repair["Shrink"][0] == 1 and repair["Agree"][0] == 1 and repair["Split"][0] == 1, repair
        assert repair["Split"][2] == 8 * (p["ranks"] - 1), repair  # every survivor's (color, key)
        assert p["per_rank"]["steady"]["calls"] == buckets + 2
    assert res["repair_at_most_linear"]
    assert res["fits"]["steady"]["calls"] == pytest.approx(0, abs=1e-9) and res["fits"]["steady"]["sent"] == pytest.approx(0, abs=1e-9)
    assert res["repair_bytes_vs_survivors_k"] <= 1.0 + 1e-6
    lines = out.strip().splitlines()
    assert any("repair bytes (sent + received) per rank vs survivors" in line for line in lines), out
    assert lines[-1].startswith("steady step per rank 4 -> 16 ranks:") and "(constant, ratio 1.00)" in lines[-1], lines[-1]
