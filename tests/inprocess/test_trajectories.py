"""In-process tests of benchmarks/trajectories.py's compare: the bitwise before/after check of issue 24.

The check is only worth having if it sees every difference that matters (a loss's last bit, one
parameter bit, a membership, an int turned float) and none of the wall-clock fields it drops.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch


from benchmarks import trajectories  # noqa: E402


def _write(config: Path, ledger: list[dict], params: dict[int, dict[str, torch.Tensor]], ranks: dict[int, dict]) -> None:
    config.mkdir(parents=True)
    (config / "ledger.jsonl").write_text("".join(json.dumps(line) + "\n" for line in ledger))
    for r, p in params.items():
        torch.save(p, config / f"params{r}.pt")
    for r, res in ranks.items():
        (config / f"rank{r}.json").write_text(json.dumps(res))


def _recording(root: Path) -> tuple[list[dict], dict[int, dict[str, torch.Tensor]], dict[int, dict]]:
    ledger = [
        {"step": s, "loss": 5.5 - 0.1 * s, "replicas": [0, 1], "faults": [], "world_epoch": 0, "step_time_s": 0.05 * s,
         "recovery_s": 0, "joins": [{"replica": 1, "transfer_s": 0.01, "pause_s": 0.03, "ok": True}] if s == 1 else []}
        for s in range(3)
    ]
    params = {0: {"w": torch.linspace(-1, 1, 6), "b": torch.zeros(2)}}
    ranks = {0: {"rank": 0, "epoch": 0, "sdc_checks": 3, "last": dict(ledger[-1])}}
    _write(root / "cfg", ledger, params, ranks)
    return ledger, params, ranks


def _flip_last_bit(x: float) -> float:
    return struct.unpack("<d", struct.pack("<q", struct.unpack("<q", struct.pack("<d", x))[0] ^ 1))[0]


def test_wall_clock_fields_are_the_only_ones_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _recording(tmp_path / "a")
    ledger, params, ranks = _recording(tmp_path / "b_base")
    for line in ledger:
        line["step_time_s"] += 7.0
        line["recovery_s"] = 2.5
        for j in line["joins"]:
            j["transfer_s"], j["pause_s"] = 9.0, 9.0
    ranks[0]["last"] = dict(ledger[-1])
    _write(tmp_path / "b" / "cfg", ledger, params, ranks)
    assert trajectories.compare(tmp_path / "a", tmp_path / "b") == 0
    assert capsys.readouterr().out.splitlines() == ["cfg: same", "1/1 configurations bitwise equal"]


@pytest.mark.parametrize("change", ["loss_last_bit", "membership", "join_ok", "param_bit", "negative_zero", "int_to_float", "missing_rank"])
def test_every_other_difference_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str) -> None:
    _recording(tmp_path / "a")
    ledger, params, ranks = _recording(tmp_path / "b_base")
    if change == "loss_last_bit":
        ledger[2]["loss"] = _flip_last_bit(ledger[2]["loss"])
    elif change == "membership":
        ledger[1]["replicas"] = [0]
    elif change == "join_ok":
        ledger[1]["joins"][0]["ok"] = False
    elif change == "param_bit":
        params[0]["w"].view(torch.int32)[3] ^= 1
    elif change == "negative_zero":  # -0.0 == 0.0 as values, not as bits
        params[0]["b"][1] = -0.0
    elif change == "int_to_float":
        ranks[0]["sdc_checks"] = 3.0
    elif change == "missing_rank":
        ranks = {1: ranks[0]}
    _write(tmp_path / "b" / "cfg", ledger, params, ranks)
    assert trajectories.compare(tmp_path / "a", tmp_path / "b") == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "0/1 configurations bitwise equal" and out[0].startswith("cfg: ") and out[0] != "cfg: same", out


def test_a_compact_ledger_compares_with_the_full_one_it_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33: a recording made before the compact line format and one made after compare by meaning."""
    from harness.ledgers import FIXTURE, write_fixture_run

    params = {0: {"w": torch.zeros(2)}}
    for name, write in (("a", lambda p: p.write_text(FIXTURE.read_text())), ("b", write_fixture_run)):
        config = tmp_path / name / "cfg"
        _write(config, [], params, {0: {"rank": 0}})
        write(config / "ledger.jsonl")
    assert trajectories.compare(tmp_path / "a", tmp_path / "b") == 0
    # A compact line whose ids differ is a difference.
    lines = (tmp_path / "b" / "cfg" / "ledger.jsonl").read_text().splitlines()
    bad = json.loads(lines[2])
    bad["ids"] = [[12, 17], [18, 19]]
    (tmp_path / "b" / "cfg" / "ledger.jsonl").write_text("\n".join([*lines[:2], json.dumps(bad), *lines[3:]]) + "\n")
    capsys.readouterr()
    assert trajectories.compare(tmp_path / "a", tmp_path / "b") == 1
    assert "ledger[2].microbatch_ids[5]: 17 vs 18" in capsys.readouterr().out
