"""Planned microbatches through the user's DataLoader: worker prefetch that never breaks exactly-once.

Which microbatches a replica computes is decided step by step by the workload policy, and a
failure changes it inside a step (replayed ids, a promoted spare). The user's DataLoader
settings (``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``,
``worker_init_fn``, ``multiprocessing_context``, ``generator``, ``timeout``) are kept by
rebuilding the loader around a :class:`PlannedBatchSampler`: it yields, in the main
process, the sample indices of the microbatches this replica is planned to compute -- the
current step's plan, then the steady plan of the live replicas for the steps after it -- so
the workers load them while the model computes.

:class:`MicrobatchFeed` hands the engine the microbatch it asks for, ``(step, offset)``:

* the head of the prefetch stream when it is that microbatch; every delivered batch carries
  its key from the worker, and a key other than the one the stream announced is an error,
  so a wrong microbatch is never delivered;
* otherwise it is fetched directly (a boundary step's replayed ids, a re-planned step).
  Streamed microbatches no step will ask for any more (an earlier step's, or passed over)
  are dropped, never delivered. When a failure changed the plan of a step the stream has
  already planned, the stream restarts from the next step (keeping what the current step
  still needs), so from the step after a failure every microbatch is streamed again.

Randomness: each microbatch is loaded under ``torch`` seeded with its own
:meth:`~lightning_recover.feed.data.MicrobatchSource.seed_for` seed (in whichever process loads
it), and the main process resumes the forward from the generator state the load left, so
random augmentations and dropout are bitwise the same whether a microbatch was prefetched
by a worker or fetched directly, on whichever replica -- exactly as a direct fetch after
``torch.manual_seed(seed)``. No MPI here: worker processes never touch MPI, and each one
dies with its rank (``PR_SET_PDEATHSIG`` on Linux) so a SIGKILLed rank leaves no loader
processes behind.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils.data import DataLoader, Dataset


__all__ = [
    "Delivered",
    "EnginePlan",
    "FeedStats",
    "KeyedCollate",
    "MicrobatchFeed",
    "PlanView",
    "PlannedBatchSampler",
    "PlannedIndices",
    "SeededDataset",
    "WorkerInit",
    "stream_loader",
]

#: (step, step-local offset): which microbatch of which optimizer step.
Key = tuple[int, int]


class PlannedIndices(list):  # type: ignore[type-arg]
    """The dataset indices of one microbatch, with its key and load seed (pickled to a worker as is)."""

    def __init__(self, indices: Iterable[int], key: Key, seed: int) -> None:
        super().__init__(indices)
        self.key = key
        self.seed = seed


class Delivered(NamedTuple):
    """A loaded microbatch: its key, the torch CPU generator state its load left, the collated batch.

    A NamedTuple so that ``pin_memory`` pins the batch inside it as it would the bare batch."""

    key: Key
    rng_state: torch.Tensor
    batch: Any


class _Loaded(list):  # type: ignore[type-arg]
    """Samples of one microbatch on their way from ``__getitems__`` to the collate function."""

    def __init__(self, samples: Iterable[Any], key: Key, rng_state: torch.Tensor) -> None:
        super().__init__(samples)
        self.key = key
        self.rng_state = rng_state


class SeededDataset(Dataset):  # type: ignore[type-arg]
    """The user's map-style dataset, loading each planned microbatch under its own seed.

    Attribute reads and writes go to the user's dataset, so a ``worker_init_fn`` that
    configures ``get_worker_info().dataset`` (e.g. opens a file per worker) still works.
    """

    def __init__(self, dataset: Any) -> None:
        object.__setattr__(self, "dataset", dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (while unpickling): no recursion into the user's dataset
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.dataset, name, value)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: PlannedIndices) -> _Loaded:
        # Seed only the CPU generator, and restore the caller's state afterwards: in the main
        # process (a direct fetch) the forward's RNG is set from the returned state instead.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(indices.seed)
            getitems = getattr(self.dataset, "__getitems__", None)
            samples = getitems(list(indices)) if getitems is not None else [self.dataset[i] for i in indices]
            state = torch.get_rng_state()
        return _Loaded(samples, indices.key, state)


class KeyedCollate:
    """The user's collate function, keeping the microbatch's key and RNG state next to the batch."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, loaded: _Loaded) -> Delivered:
        return Delivered(loaded.key, loaded.rng_state, self.collate_fn(list(loaded)))


_PR_SET_PDEATHSIG = 1


class WorkerInit:
    """Runs in every loader worker: die with the rank, then the user's ``worker_init_fn``.

    A rank SIGKILLed by fault injection or a crash cannot shut its workers down; without
    this they would linger until torch's parent check noticed (seconds), holding the
    rank's output pipes open."""

    def __init__(self, user_fn: Callable[[int], None] | None, parent: int) -> None:
        self.user_fn = user_fn
        self.parent = parent

    def __call__(self, worker_id: int) -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != self.parent:  # the rank died before the prctl: follow it now
                os._exit(1)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class SourceView(Protocol):
    """What the feed reads of :class:`lightning_recover.feed.data.MicrobatchSource`.

    A protocol rather than the class: that module builds on this one, so this one names only
    what it uses of it (and never imports it).
    """

    seeded: SeededDataset
    keyed_collate: KeyedCollate

    def seed_for(self, step: int, offset: int) -> int: ...

    def planned_indices(self, step: int, offset: int) -> PlannedIndices: ...

    def load(self, step: int, offset: int) -> Delivered: ...


class PlanView(Protocol):
    """What the sampler reads of the engine (all in the main process)."""

    def current_step(self) -> int:
        """The lowest step that may still be asked for: the open step, or the next one between steps."""

    def ids(self, step: int) -> tuple[int, ...]:
        """This replica's planned step-local offsets of ``step``: the live plan for the open step,
        the steady plan of the replicas live now for a later one."""


class EnginePlan:
    """:class:`PlanView` of a :class:`~lightning_recover.recovery.engine.StepEngine` and its planner."""

    def __init__(self, engine: Any, next_step: Callable[[], int]) -> None:
        self.engine = engine
        self.next_step = next_step

    def current_step(self) -> int:
        st = self.engine.state
        return st.step if st is not None else self.next_step()

    def ids(self, step: int) -> tuple[int, ...]:
        st = self.engine.state
        if st is not None and st.step == step:
            return tuple(st.mine.ids)
        comm = self.engine.comm
        # The policy keeps the answer for the communicator's live tuple: O(log W) a step.
        return tuple(self.engine.policy.steady_ids(comm.alive_replicas, comm.replica))


class PlannedBatchSampler:
    """Batch sampler yielding the planned microbatches of one data epoch, step after step.

    Runs in the main process (the DataLoader asks it for the next indices as batches are
    consumed), so it plans each step from the plan as it is when the stream reaches that
    step, and records it in ``planned`` (the feed compares it with the plan later on). A
    step the engine has already passed is skipped. Every yielded key is appended to
    ``announced``, the feed's record of what is in flight, in order.
    """

    def __init__(self, source: SourceView, plan: PlanView, announced: collections.deque[Key]) -> None:
        self.source = source
        self.plan = plan
        self.announced = announced
        self.planned: dict[int, tuple[int, ...]] = {}
        self.first_step = 0
        self.end_step = 0

    def __iter__(self) -> Iterator[PlannedIndices]:
        self.planned.clear()
        step, end = self.first_step, self.end_step
        while step < end:
            current = self.plan.current_step()
            if step < current:  # the engine is ahead of the stream: nothing before it is asked for
                step = current
                continue
            for old in [s for s in self.planned if s < current]:
                del self.planned[old]
            ids = self.planned[step] = self.plan.ids(step)
            for offset in ids:
                self.announced.append((step, offset))
                yield self.source.planned_indices(step, offset)
            step += 1


class FeedStats(NamedTuple):
    streamed: int  # delivered from the prefetch stream
    direct: int  # fetched in the main process when asked
    dropped: int  # prefetched but never asked for (plan changed)
    restarts: int  # the stream was restarted because the plan changed


class MicrobatchFeed:
    """Gives the engine microbatch ``(step, offset)``: from the workers' stream when it is next, else directly.

    When the plan of a step the stream has already planned changed (a replica was lost), the
    stream is restarted: from the step asked for if this is its first microbatch, else from
    the next step. With ``num_workers=0`` every microbatch is fetched directly when asked,
    as a plain DataLoader would (nothing is loaded ahead, so nothing can be wasted).
    ``loader_factory(dataset, batch_sampler, collate_fn)`` builds the stream's loader; the
    default is a DataLoader with the user's settings.
    """

    def __init__(
        self,
        source: SourceView,
        user_loader: Any,
        plan: PlanView,
        *,
        loader_factory: Callable[[SeededDataset, PlannedBatchSampler, KeyedCollate], Iterable[Delivered]] | None = None,
    ) -> None:
        self.source = source
        self.plan = plan
        self.announced: collections.deque[Key] = collections.deque()
        self.sampler = PlannedBatchSampler(source, plan, self.announced)
        workers = int(getattr(user_loader, "num_workers", 0) or 0)
        self.loader: Iterable[Delivered] | None = None
        if loader_factory is not None:
            self.loader = loader_factory(source.seeded, self.sampler, source.keyed_collate)
        elif workers > 0:
            self.loader = stream_loader(user_loader, source.seeded, self.sampler, source.keyed_collate)
        self._it: Iterator[Delivered] | None = None
        self._end_step = 0
        self._last_step: int | None = None
        # Loaded microbatches of the current step kept across a restart of the stream.
        self._held: dict[Key, Delivered] = {}
        self._streamed = self._direct = self._dropped = self._restarts = 0

    @property
    def streams(self) -> bool:
        """Whether microbatches are loaded ahead (the user's loader has workers)."""
        return self.loader is not None

    @property
    def stats(self) -> FeedStats:
        return FeedStats(self._streamed, self._direct, self._dropped, self._restarts)

    def start_epoch(self, first_step: int, end_step: int) -> None:
        """A data epoch begins: stream steps ``first_step .. end_step - 1`` (the previous stream is dropped)."""
        self._end_step = end_step
        self._stream_from(first_step)

    def _stream_from(self, first_step: int) -> None:
        self._it = None  # a loader without persistent workers shuts its workers down here
        self.announced.clear()
        if self.loader is None or first_step >= self._end_step:
            return
        self.sampler.first_step, self.sampler.end_step = first_step, self._end_step
        self._it = iter(self.loader)

    def get(self, step: int, offset: int) -> Any:
        """The collated batch of microbatch ``(step, offset)``, with torch's RNG set for its forward.

        On return torch is seeded as after ``torch.manual_seed(source.seed_for(step, offset))``
        followed by loading the batch in this process."""
        if self._it is not None:
            self._resync(step)
        if self._held and self._last_step != step:
            self._dropped += len(self._held)
            self._held.clear()
        self._last_step = step
        delivered = self._held.pop((step, offset), None)
        if delivered is not None:
            self._streamed += 1
        else:
            delivered = self._from_stream((step, offset))
        if delivered is None:
            self._direct += 1
            delivered = self.source.load(step, offset)
        if torch.accelerator.is_available():
            # The device generators (CUDA dropout); the CPU one is set from the load just below.
            # Without an accelerator there is nothing else to seed, and torch.manual_seed would
            # still queue a lazy seed per device type with a formatted stack (~70 us a call).
            torch.manual_seed(self.source.seed_for(step, offset))
        torch.set_rng_state(delivered.rng_state)
        return delivered.batch

    def _resync(self, step: int) -> None:
        """Restart the stream if a step it planned is planned differently now."""
        planned = self.sampler.planned
        if self._last_step != step and step in planned and planned[step] != self.plan.ids(step):
            self._restart(step)
        elif any(s > step and ids != self.plan.ids(s) for s, ids in planned.items()):
            # Microbatches of this step already on their way that it still needs are kept.
            wanted = set(self.plan.ids(step))
            while self.announced and self.announced[0][0] <= step:
                key = self.announced[0]
                delivered = self._next()
                if key[0] == step and key[1] in wanted:
                    self._held[key] = delivered
                else:
                    self._dropped += 1
            self._restart(step + 1)

    def _restart(self, first_step: int) -> None:
        self._restarts += 1
        self._dropped += len(self.announced)
        self._stream_from(first_step)

    def _from_stream(self, key: Key) -> Delivered | None:
        if self._it is None:
            return None
        # Streamed microbatches of earlier steps will never be asked for again.
        while self.announced and self.announced[0][0] < key[0]:
            self._next()
            self._dropped += 1
        if key not in self.announced:
            return None
        while True:
            delivered = self._next()
            if delivered.key == key:
                self._streamed += 1
                return delivered
            self._dropped += 1  # passed over: the plan no longer asks for it before `key`

    def _next(self) -> Delivered:
        assert self._it is not None
        expected = self.announced.popleft()
        delivered = next(self._it)
        if tuple(delivered.key) != expected:
            raise RuntimeError(
                f"the train DataLoader delivered microbatch {tuple(delivered.key)} where {expected} was due; "
                "the loader must deliver batches in the order its batch_sampler yields them (keep in_order=True)"
            )
        return delivered

    def close(self) -> None:
        """Stop the stream and let the loader's workers go (persistent ones included)."""
        self._it = None
        self.loader = None
        self.announced.clear()
        self._held.clear()


def stream_loader(user: Any, dataset: SeededDataset, batch_sampler: PlannedBatchSampler, collate_fn: KeyedCollate) -> DataLoader:
    """A DataLoader over the planned microbatches with the user's loader settings (public attributes)."""
    kwargs: dict[str, Any] = dict(
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=user.num_workers,
        pin_memory=user.pin_memory,
        timeout=user.timeout,
        worker_init_fn=WorkerInit(user.worker_init_fn, os.getpid()),
        multiprocessing_context=user.multiprocessing_context,
        generator=user.generator,
        prefetch_factor=user.prefetch_factor,
        persistent_workers=user.persistent_workers,
        # The feed checks each batch's key against the order the sampler announced.
        in_order=True,
    )
    if getattr(user, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = user.pin_memory_device
    return DataLoader(dataset, **kwargs)
