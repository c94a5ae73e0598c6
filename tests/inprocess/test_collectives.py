"""Object collectives whose bytes arrive garbled: a peer's death when one is known, the error itself otherwise.

The host campaign (benchmarks/chaos.py --hosts 2) found a corruption check's allgather
raising MemoryError on the survivors when a host's ranks were SIGKILLed mid-collective: mpi4py
had gathered a size that was never sent. That is a membership change, never a crash.
"""

from __future__ import annotations

import pickle

import pytest

from lightning_recover.comm.collectives import UNPICKLING_ERRORS, Collectives
from lightning_recover.comm.interface import PeerFailure


class _World:
    """The world communicator's object collectives, failing as a peer's death left them."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def allgather(self, obj: object) -> list[object]:
        raise self.error

    def bcast(self, obj: object, root: int = 0) -> object:
        raise self.error


class _Comm(Collectives):
    def __init__(self, error: BaseException, *, failure_known: bool) -> None:
        self.world = _World(error)  # type: ignore[assignment]
        self.failure_known = failure_known
        self.asked: list[str] = []

    def _failure_confirmed(self) -> bool:  # type: ignore[override]
        return self.failure_known

    def peer_failure(self, where: str) -> PeerFailure:  # type: ignore[override]
        self.asked.append(where)
        return PeerFailure((3,), where, None)


@pytest.mark.parametrize("error", [MemoryError(), OverflowError("size"), EOFError(), pickle.UnpicklingError("bad")])
@pytest.mark.parametrize("call", ["allgather", "broadcast"])
def test_garbled_bytes_with_a_known_failure_are_a_peer_failure(error: BaseException, call: str) -> None:
    comm = _Comm(error, failure_known=True)
    with pytest.raises(PeerFailure) as info:
        comm.allgather_object("x") if call == "allgather" else comm.bcast_object("x")
    assert info.value.lost_ranks == (3,) and comm.asked == [call]


@pytest.mark.parametrize("call", ["allgather", "broadcast"])
def test_garbled_bytes_without_a_failure_stay_the_error_they_are(call: str) -> None:
    comm = _Comm(MemoryError("real"), failure_known=False)
    with pytest.raises(MemoryError, match="real"):
        comm.allgather_object("x") if call == "allgather" else comm.bcast_object("x")
    assert comm.asked == []


def test_only_deserialization_errors_are_read_as_a_death() -> None:
    assert ValueError not in UNPICKLING_ERRORS and KeyboardInterrupt not in UNPICKLING_ERRORS
