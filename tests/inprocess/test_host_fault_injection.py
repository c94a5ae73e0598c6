"""FaultInjection's host-level kinds: the schedule they accept, and the request/confirm contract with a harness."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from lightning_recover.callbacks import FaultInjection, FaultSpec
from lightning_recover.callbacks import fault_injection as fi


@pytest.mark.parametrize("kind", fi.HOST_KINDS)
def test_host_kinds_parse(kind: str) -> None:
    spec = FaultSpec.parse({"step": 2, "rank": 3, "phase": "reduce", "kind": kind})
    assert spec.kind == kind and spec.rank == 3
    assert spec.seconds == (fi.FLAP_DEFAULT_S if kind == "host_flap" else None)


@pytest.mark.parametrize("phase", ["join_startup", "join_transfer", "joined"])
def test_a_host_fault_may_hit_a_replacements_host(phase: str) -> None:
    # The replacement runs on the spare host (membership.placement): its request names that host.
    spec = FaultSpec.parse({"step": 1, "rank": 1, "phase": phase, "kind": "host_freeze"})
    assert (spec.phase, spec.kind) == (phase, "host_freeze")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"step": 1, "rank": 1, "phase": "reduce", "kind": "host_partition", "seconds": 2}, "applies only to kind=host_flap"),
        ({"step": 1, "rank": 1, "phase": "reduce", "kind": "host_flap", "seconds": 0}, r"seconds=0 must be a number of seconds"),
        ({"step": 1, "rank": 1, "phase": "reduce", "kind": "host_flap", "seconds": "3"}, r"seconds='3' must be"),
    ],
)
def test_host_kind_mistakes_name_the_fix(entry: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultSpec.parse(entry)


def test_a_host_fault_is_requested_and_waits_for_the_harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fi.ENV_HOST_FAULTS, str(tmp_path))
    cb = FaultInjection([{"step": 1, "rank": 2, "phase": "backward", "kind": "host_flap", "seconds": 4.5}])
    seen: dict = {}

    def harness() -> None:
        req = tmp_path / "request.2.1.backward.json"
        for _ in range(500):
            if req.exists():
                break
            threading.Event().wait(0.01)
        seen["request"] = json.loads(req.read_text())
        seen["returned_early"] = seen_return.is_set()
        (tmp_path / "done.2.1.backward").touch()

    seen_return = threading.Event()
    t = threading.Thread(target=harness)
    t.start()
    cb.at("backward", step=0, rank=2, microbatch=0)  # another step: nothing
    cb.at("backward", step=1, rank=2, microbatch=0)
    seen_return.set()
    t.join(10)
    assert seen["returned_early"] is False, "the rank must wait for the harness's confirmation"
    req = seen["request"]
    assert {k: req[k] for k in ("kind", "rank", "step", "phase", "seconds")} == {
        "kind": "host_flap", "rank": 2, "step": 1, "phase": "backward", "seconds": 4.5}
    assert req["host"] == socket.gethostname()
    cb.at("backward", step=1, rank=2, microbatch=0)  # fires once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.2.1.backward", "request.2.1.backward.json"]


def test_a_host_fault_without_a_harness_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fi.ENV_HOST_FAULTS, raising=False)
    cb = FaultInjection([{"step": 0, "rank": 0, "phase": "reduce", "kind": "host_partition"}])
    with pytest.raises(RuntimeError, match=fi.ENV_HOST_FAULTS):
        cb.at("reduce", step=0, rank=0, bucket=0)


def test_an_unconfirmed_host_fault_times_out_with_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fi.ENV_HOST_FAULTS, str(tmp_path))
    monkeypatch.setattr(fi, "HOST_FAULT_ACK_S", 0.2)
    cb = FaultInjection([{"step": 0, "rank": 1, "phase": "optimizer", "kind": "host_freeze"}])
    with pytest.raises(RuntimeError, match="no harness confirmed it"):
        cb.at("optimizer", step=0, rank=1)
    assert (tmp_path / "request.1.0.optimizer.json").exists()
