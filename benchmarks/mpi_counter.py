"""Counts the MPI calls and payload bytes a rank's real code makes, per phase (benchmarks/control_plane.py).

A measuring instrument, not part of the package: :func:`install` replaces
``mpi4py.MPI.COMM_WORLD`` with a :class:`CountingIntracomm` (a subclass of
``MPI.Intracomm`` over the same handle) before the code under test builds its
communicators. Every communicator derived from it (``Dup``, ``Split``, ``Shrink``,
``Create_group``) is wrapped the same way, so every call the real code makes on any of
them -- the step's bucket reductions on the shard communicator, the loss header on the
world, the agreement, a repair's shrink and splits -- goes through :meth:`Counter.note`.
Nothing in ``lightning_recover`` knows about it.

What is counted, per MPI operation name (``Iallreduce``, ``Iagree``, ``Split`` ...):

* ``calls``: operations that communicate, or create or revoke a communicator. Local
  queries (``Get_size``, ``Get_group``, ``Ack_failed``, ``Get_failed``, ``Is_revoked``,
  ``Iprobe``) are counted apart as ``local``; the tests of a pending request
  (``Request.Test`` in :mod:`lightning_recover.comm.mpi_wait`) are not counted at all: how
  often a wait polls depends on the scheduler, not on the protocol.
* ``sent`` / ``recv``: the payload this rank hands to MPI and gets back, in bytes: a
  reduction's buffer both ways; a broadcast's buffer (sent by the root, received by the
  others); an object collective's pickles (``allgather`` receives every member's row); an
  agreement's int; ``Split``'s (color, key) pair sent and every member's pair received --
  the all-gather any ``MPI_Comm_split`` implies (Open MPI's ``ompi_comm_split`` gathers
  them; the semantics need every rank's color). ``Shrink``, ``Dup``, ``Create_group`` and
  ``Revoke`` carry no payload of the caller's: 0 bytes, their calls are counted.

These are the protocol's own costs, what its code asks of MPI. The bytes MPI's algorithms
put on the wire on top (a recursive-doubling all-reduce sends its buffer log2 n times;
ULFM's agreement runs over a tree) are the library's and are modelled, with published
measurements, in ``benchmarks/control_plane_model.py``. Open MPI's own counters (the
``pml_monitoring`` MPI_T variables) would show them, but that component is not loaded
under ``--with-ft ulfm`` (checked with Open MPI 5.0.11: its variables are absent).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

__all__ = ["Counter", "CountingIntracomm", "install", "payload", "since"]

#: Calls that neither communicate nor create a communicator: counted apart (``local``).
LOCAL = frozenset({"Ack_failed", "Get_failed", "Iprobe"})


def payload(spec: Any) -> int:
    """Bytes of an mpi4py buffer argument (array, ``[buf, type]``, ``[buf, count, type]``); 0 for ``IN_PLACE``/None."""
    if spec is None or spec is MPI.IN_PLACE:
        return 0
    if isinstance(spec, (list, tuple)):
        spec = spec[0]
        if spec is None or spec is MPI.IN_PLACE:
            return 0
    return memoryview(spec).nbytes


class Counter:
    """Per-operation tallies of one rank: ``{name: [calls, sent, recv]}``, and local calls apart."""

    def __init__(self) -> None:
        self.ops: dict[str, list[int]] = {}
        self.local: dict[str, int] = {}

    def note(self, name: str, sent: int = 0, recv: int = 0) -> None:
        if name in LOCAL:
            self.local[name] = self.local.get(name, 0) + 1
            return
        row = self.ops.setdefault(name, [0, 0, 0])
        row[0] += 1
        row[1] += sent
        row[2] += recv

    def snapshot(self) -> dict[str, list[int]]:
        """A copy of the tallies now (compare two with :meth:`since`)."""
        return {k: list(v) for k, v in self.ops.items()}

    def since(self, before: dict[str, list[int]]) -> dict[str, list[int]]:
        """What was counted after ``before`` (a :meth:`snapshot`), operations with no call left out."""
        return since(before, self.ops)


def since(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, list[int]]:
    """What was counted between two :meth:`Counter.snapshot` s, operations with no call left out."""
    out = {}
    for name, (calls, sent, recv) in after.items():
        c0, s0, r0 = before.get(name, (0, 0, 0))
        if calls - c0:
            out[name] = [calls - c0, sent - s0, recv - r0]
    return out


#: The one counter of this process (set by :func:`install`).
COUNTER = Counter()


def _pickled(obj: Any) -> int:
    return len(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))


class CountingIntracomm(MPI.Intracomm):
    """``MPI.Intracomm`` that tallies each call in :data:`COUNTER` and wraps the communicators it creates."""

    # ---- communicators created: wrapped so that their calls are counted too
    def _wrap(self, comm: Any) -> Any:
        if isinstance(comm, MPI.Intracomm) and not isinstance(comm, CountingIntracomm) and comm != MPI.COMM_NULL:
            return CountingIntracomm(comm)
        return comm

    def Dup(self, *args: Any, **kwargs: Any) -> Any:
        COUNTER.note("Dup")
        return self._wrap(super().Dup(*args, **kwargs))

    def Split(self, color: int = 0, key: int = 0) -> Any:
        COUNTER.note("Split", 8, 8 * self.Get_size())
        return self._wrap(super().Split(color, key))

    def Shrink(self) -> Any:
        COUNTER.note("Shrink")
        return self._wrap(super().Shrink())

    def Create_group(self, *args: Any, **kwargs: Any) -> Any:
        COUNTER.note("Create_group")
        return self._wrap(super().Create_group(*args, **kwargs))

    def Revoke(self) -> None:
        COUNTER.note("Revoke")
        super().Revoke()

    # ---- agreement
    def Agree(self, flag: int) -> int:
        COUNTER.note("Agree", 4, 4)
        return super().Agree(flag)

    def Iagree(self, flag: Any) -> Any:
        n = payload(flag)
        COUNTER.note("Iagree", n, n)
        return super().Iagree(flag)

    # ---- buffer collectives
    def _reduction(self, name: str, call: Callable[..., Any], send: Any, recv: Any, *rest: Any, **kwargs: Any) -> Any:
        n = payload(recv) or payload(send)
        COUNTER.note(name, n, n)
        return call(send, recv, *rest, **kwargs)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, *args: Any, **kwargs: Any) -> Any:
        return self._reduction("Allreduce", super().Allreduce, sendbuf, recvbuf, *args, **kwargs)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, *args: Any, **kwargs: Any) -> Any:
        return self._reduction("Iallreduce", super().Iallreduce, sendbuf, recvbuf, *args, **kwargs)

    def Bcast(self, buf: Any, root: int = 0) -> Any:
        n = payload(buf)
        me = self.Get_rank() == root
        COUNTER.note("Bcast", n if me else 0, 0 if me else n)
        return super().Bcast(buf, root)

    def Ibcast(self, buf: Any, root: int = 0) -> Any:
        n = payload(buf)
        me = self.Get_rank() == root
        COUNTER.note("Ibcast", n if me else 0, 0 if me else n)
        return super().Ibcast(buf, root)

    def Barrier(self) -> None:
        COUNTER.note("Barrier")
        super().Barrier()

    def Ibarrier(self) -> Any:
        COUNTER.note("Ibarrier")
        return super().Ibarrier()

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> Any:
        COUNTER.note("Allgather", payload(sendbuf), payload(recvbuf))
        return super().Allgather(sendbuf, recvbuf)

    # ---- point to point (the state transfer of a re-join)
    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        COUNTER.note("Send", payload(buf), 0)
        super().Send(buf, dest, tag)

    def Recv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: Any = None) -> None:
        COUNTER.note("Recv", 0, payload(buf))
        super().Recv(buf, source, tag, status)

    # ---- object collectives (pickles)
    def bcast(self, obj: Any, root: int = 0) -> Any:
        me = self.Get_rank() == root
        out = super().bcast(obj, root)
        n = _pickled(out)
        COUNTER.note("bcast", n if me else 0, 0 if me else n)
        return out

    def allgather(self, sendobj: Any) -> Any:
        out = super().allgather(sendobj)
        COUNTER.note("allgather", _pickled(sendobj), sum(_pickled(row) for row in out))
        return out

    def gather(self, sendobj: Any, root: int = 0) -> Any:
        out = super().gather(sendobj, root)
        COUNTER.note("gather", _pickled(sendobj), sum(_pickled(row) for row in out) if out is not None else 0)
        return out

    def allreduce(self, sendobj: Any, *args: Any, **kwargs: Any) -> Any:
        n = _pickled(sendobj)
        COUNTER.note("allreduce", n, n)
        return super().allreduce(sendobj, *args, **kwargs)

    # ---- local queries (counted apart)
    def Ack_failed(self, *args: Any, **kwargs: Any) -> Any:
        COUNTER.note("Ack_failed")
        return super().Ack_failed(*args, **kwargs)

    def Get_failed(self) -> Any:
        COUNTER.note("Get_failed")
        return super().Get_failed()

    def Iprobe(self, *args: Any, **kwargs: Any) -> Any:
        COUNTER.note("Iprobe")
        return super().Iprobe(*args, **kwargs)


def install() -> Counter:
    """Count from now on: ``MPI.COMM_WORLD`` becomes a :class:`CountingIntracomm` (call before building any communicator)."""
    if not isinstance(MPI.COMM_WORLD, CountingIntracomm):
        MPI.COMM_WORLD = CountingIntracomm(MPI.COMM_WORLD)
    return COUNTER
