"""Overlapping a step's cross-replica reduction with its last backward (ReCoVer's in-step recovery).

Stock HSDP starts reducing a gradient bucket as soon as backward has produced it; the
first reduction round of a recovery step can do the same. The engine starts an
:class:`OverlappedReduction` just before the last microbatch's backward: a helper thread
runs the ordinary bucketed ``comm.allreduce`` (same buckets, same world-epoch tags, the
same out-of-place rollback copy), but waits before each bucket until every tensor in it
is *ready* -- backward marked its final gradient (:meth:`mark_ready`, from a
post-accumulate-grad hook) -- so the reduction of the last layers' gradients runs while
the first layers' backward still computes. The buckets are planned over the gradients in
reverse parameter order, the order backward produces them.

The contract:

* Exactly one reduction is in flight per step and only in its first round. A failure in
  it is not raised in the helper thread: :meth:`join` re-raises it in the caller, which
  then agrees, repairs and redoes the stale buckets synchronously exactly as without
  overlap. Recovery never overlaps (it is rare; simplicity wins).
* The caller marks everything ready once backward returned (:meth:`all_ready`): a
  parameter that got no gradient this step must not hold the reduction forever.
* The helper is one long-lived thread per engine (:class:`HelperThread`), idle between
  rounds: starting a thread per step cost a start-up hand-shake on the step's path (a
  scheduler time slice on an oversubscribed host).
* The thread is the only one issuing collectives on the replica communicator meanwhile;
  the main thread only computes (the in-replica reduce-scatter runs on torch's own group).
* Watching for hangs: fault points and progress ticks fire in the helper thread before
  each bucket, as in the synchronous path. While the caller waits in :meth:`join`, it
  counts as *computing* whenever the helper is outside a collective (so a rank wedged
  between buckets is still seen as stuck) and as *waiting* inside one.

Pure Python: threads and the :class:`~.interface.ReplicaComm` contract; no MPI, no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from lightning_recover.comm.buckets import ReduceHandle
from lightning_recover.comm.interface import ReplicaComm

__all__ = ["HelperThread", "OverlappedReduction"]


class HelperThread:
    """A daemon thread that runs one job at a time, reused for every step's overlapped round.

    :meth:`submit` hands it a job and returns an event set once the job returned (its
    errors are the job's to keep: :class:`OverlappedReduction` stores them). The thread
    starts with the first job, and again after a fork (a child process has no threads).
    """

    def __init__(self, name: str = "lightning-recover-reduce") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._job: tuple[Callable[[], None], threading.Event] | None = None
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        """No job is running (a round abandoned by an exception may still be finishing)."""
        with self._cond:
            return self._job is None

    def submit(self, job: Callable[[], None]) -> threading.Event:
        done = threading.Event()
        with self._cond:
            if self._job is not None:
                raise RuntimeError(f"{self.name}: a job is still running; wait for its event before submitting the next")
            self._job = (job, done)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return done

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None)
                job, done = self._job  # type: ignore[misc]
            try:
                job()
            finally:
                with self._cond:
                    self._job = None
                done.set()


class OverlappedReduction:
    """One step's first reduction round, run by a helper thread as its buckets become ready.

    ``send`` / ``out`` are in *plane order* (the order ``handle`` was planned over);
    ``index_of(i)`` maps a caller's tensor index to its plane position. ``before_bucket``
    and ``after_bucket`` are passed to ``comm.allreduce`` (fault points, ticks, the
    ``on_bucket_reduced`` hook); they run in the helper thread: ``helper``, the engine's
    (reused by every round), or by default one started for this round only.
    """

    def __init__(
        self,
        comm: ReplicaComm,
        send: Sequence[Any],
        out: Sequence[Any],
        handle: ReduceHandle,
        *,
        before_bucket: Callable[[int], None] | None = None,
        after_bucket: Callable[[int], None] | None = None,
        helper: HelperThread | None = None,
    ) -> None:
        if len(send) != len(out):
            raise ValueError(f"got {len(send)} tensors to send but {len(out)} outputs")
        self.comm = comm
        self.handle = handle
        self._send, self._out = list(send), list(out)
        self._before, self._after = before_bucket, after_bucket
        # Which plane tensors each bucket waits for.
        needs = [{ti for ti, _, _ in b.segments} for b in handle.buckets]
        # Per bucket, how many of its tensors are not ready yet; per tensor, its buckets. The
        # helper is woken only when a bucket's count reaches zero, not once per gradient (a
        # wake-up per parameter only to wait again cost GIL hand-offs during backward).
        self._missing = [len(n) for n in needs]
        self._buckets_of: dict[int, list[int]] = {}
        for b, n in enumerate(needs):
            for ti in n:
                self._buckets_of.setdefault(ti, []).append(b)
        self._ready: set[int] = set()
        self._all = False
        self._cond = threading.Condition()
        #: The helper thread is inside a collective (not running this rank's own code).
        self.in_collective = False
        self.error: BaseException | None = None
        # The engine's reused helper; a round made without one gets a thread of its own.
        self._done = (helper or HelperThread()).submit(self._run)

    # ------------------------------------------------------------------ the caller's side
    def mark_ready(self, plane_index: int, tensor: Any = None) -> None:
        """Tensor ``plane_index`` (plane order) holds its final gradient for this round.

        ``tensor``: where that gradient lives now, when backward may have put it in a new
        tensor (FSDP2 does for some units' parameters) -- it is sent instead.
        """
        with self._cond:
            if tensor is not None:
                self._send[plane_index] = tensor
            if plane_index in self._ready:
                return
            self._ready.add(plane_index)
            completed = False
            for b in self._buckets_of.get(plane_index, ()):
                self._missing[b] -= 1
                completed |= self._missing[b] == 0
            if completed:
                self._cond.notify_all()

    def sent(self, plane_index: int) -> Any:
        """The tensor the round sends (or sent) at ``plane_index``."""
        return self._send[plane_index]

    def all_ready(self) -> None:
        """Backward returned: every tensor is final, including those no backward touched."""
        with self._cond:
            self._all = True
            self._cond.notify_all()

    def join(self, *, set_computing: Callable[[bool], None] | None = None, poll_s: float = 0.02) -> None:
        """Wait for the round to finish; re-raise its error (a ``PeerFailure``) here.

        ``set_computing(flag)`` is told, every ``poll_s``, whether the helper is running
        this rank's own code (True) or blocked on peers in a collective (False).
        """
        self.all_ready()
        while not self._done.is_set():
            if set_computing is not None:
                set_computing(not self.in_collective)
            self._done.wait(poll_s)
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ the helper thread
    def _run(self) -> None:
        try:
            self.comm.allreduce(
                self._send, self._out, handle=self.handle, on_bucket=self._before_bucket, after_bucket=self._after_bucket
            )
        except BaseException as exc:  # re-raised by join() in the caller's thread
            self.error = exc
        finally:
            self.in_collective = False

    def _before_bucket(self, index: int) -> None:
        self.in_collective = False
        with self._cond:
            self._cond.wait_for(lambda: self._all or self._missing[index] == 0)
        if self._before is not None:
            self._before(index)
        self.in_collective = True

    def _after_bucket(self, index: int) -> None:
        self.in_collective = False
        if self._after is not None:
            self._after(index)
