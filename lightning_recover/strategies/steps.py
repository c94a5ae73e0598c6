"""One optimizer step of the recovery protocol, run through Lightning's training hooks.

The strategy's ``training_step``, ``backward`` and ``optimizer_step`` hooks delegate here
(:class:`TrainingSteps`); the step itself is the engine's
(:mod:`lightning_recover.recovery.engine`):

1. ``training_step`` receives a step ticket: the engine plans the step and the replica's
   first planned microbatch runs inside Lightning's closure (so ``self.log`` and the
   closure bookkeeping work as usual);
2. each backward asks the engine whether FSDP2 reduce-scatters inside the replica now,
   and before the last planned one starts the overlapped reduction;
3. ``optimizer_step`` runs the closure, the rest of the planned microbatches, and the
   reduction until one membership commits (recovery microbatches run through the same
   :class:`_Runner`); only then do ``on_before_optimizer_step``, gradient clipping and
   ``optimizer.step`` run, and the committed step is recorded (planner, ledger, logs).

Every microbatch has its own RNG stream and step-local id (``offset``); its loss and
logged values are recorded with the engine. Errors: a step left by an exception
(``TooFewReplicasError``, a user error) is abandoned in the engine before the exception
goes on; a ``training_step`` that returns no loss tensor is a ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_recover import _lightning
from lightning_recover.feed.data import MicrobatchSource
from lightning_recover.feed.loading import MicrobatchFeed
from lightning_recover.recovery import rejoin
from lightning_recover.recovery.job import RecoveryJob
from lightning_recover.recovery.overlap import OverlappedReduction
from lightning_recover.strategies.sharding import local, set_gradient_sync
from lightning_recover.strategies.step_logging import StepLogging



class StepHost(Protocol):
    """What the step hooks use of the strategy (:class:`~lightning_recover.strategies.ReCoVerHSDPStrategy`
    is one): a protocol rather than the class, so that the strategy may import this module."""

    @property
    def job(self) -> RecoveryJob: ...
    @property
    def model(self) -> Any: ...
    @property
    def precision_plugin(self) -> Any: ...
    @property
    def lightning_module(self) -> Any: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def faults_seen(self) -> int: ...
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor: ...
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any: ...
    def replica_guard(self, where: str) -> AbstractContextManager[None]: ...

__all__ = ["TrainingSteps"]


class _Runner:
    """The engine's MicrobatchRunner for one optimizer step: forward and backward through Lightning."""

    def __init__(self, steps: TrainingSteps, optimizer: Optimizer) -> None:
        self.steps = steps
        self.optimizer = optimizer

    def run_microbatch(self, offset: int) -> None:
        self.steps.run_microbatch(offset, self.optimizer)

    def local_grads(self) -> list[Tensor]:
        grads = []
        for p in self.steps.trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(local(p.grad))
        return grads


class TrainingSteps:
    """The bodies of the strategy's step hooks; see the module docstring.

    ``strategy``: its public surface only (job, model, guard, Lightning's own members);
    ``lightning_step``: Lightning's ``Strategy.training_step``, which runs the user's."""

    def __init__(self, strategy: StepHost, lightning_step: Callable[..., Any], logging: StepLogging) -> None:
        self._strategy = strategy
        self._lightning_step = lightning_step
        self._logging = logging
        self.data: MicrobatchSource | None = None
        self.feed: MicrobatchFeed | None = None
        #: The ledger record of the last committed step (also on ranks that do not write the ledger).
        self.last_record: dict[str, Any] | None = None
        #: The sharded trainable parameters, in a fixed order (the engine's gradients; set in ``setup``).
        self.trainable: list[torch.nn.Parameter] = []
        self._batch_idx = 0
        # Whether FSDP2 reduce-scatters inside the replica on the next backward.
        self._syncing = True

    def first_microbatch(self, batch_idx: int) -> Any:
        """``training_step(ticket)``: plan the step, run its first planned microbatch."""
        job = self._strategy.job
        assert job.engine is not None
        self._batch_idx = batch_idx
        if job.joining is not None:
            rejoin.first_step(job)
        job.engine.begin(self._strategy.lightning_module.trainer.global_step)  # type: ignore[union-attr]
        # The microbatches planned now run first; the last of them reduce-scatters inside the
        # replica and overlaps the cross-replica reduction (see before_backward).
        first = job.engine.start_planned()
        self._logging.begin_step()
        with self._abandon_step_on_error():
            self._logging.start()
            return self._forward(first)

    def run_microbatch(self, offset: int, optimizer: Optimizer) -> None:
        """Forward and backward of the step's microbatch ``offset`` through Lightning, its logged values captured."""
        engine = self._strategy.job.engine
        assert engine is not None
        self._logging.start()
        out = self._forward(offset)
        self._strategy.backward(out["loss"] if isinstance(out, Mapping) else out, optimizer)
        self._logging.capture(engine)

    def _forward(self, offset: int) -> Any:
        """Forward of one microbatch (step-local id ``offset``) with its own RNG stream."""
        job = self._strategy.job
        assert job.engine is not None and job.engine.state is not None and self.data is not None and job.probes is not None
        st = job.engine.state
        self._logging.offset = offset
        job.probes.fault_point("forward", step=st.step, microbatch=st.work.microbatches_run)
        job.probes.tick()
        assert self.feed is not None
        # Seeds torch for this microbatch (the same on every replica), however it was loaded.
        # As Lightning's loop prepares a batch: the precision's input conversion (true half precision
        # casts float inputs), then the device.
        batch = self._strategy.batch_to_device(self._strategy.precision_plugin.convert_input(self.feed.get(st.step, offset)))
        with self._strategy.replica_guard("forward"), self._logging.as_batch(batch, first=st.work.microbatches_run == 0):
            out = self._lightning_step(batch, self._batch_idx)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise TypeError(f"training_step must return a loss tensor (or a dict with 'loss'), got {type(out).__name__}")
        job.engine.record(offset, float(loss.detach().float()))
        return out

    def before_backward(self, optimizer: Optimizer | None) -> OverlappedReduction | None:
        """A backward inside a step starts: the in-replica sync as the engine decides, and the overlapped reduction
        before the last planned backward (returned: tell it ``all_ready()`` once backward is done)."""
        job = self._strategy.job
        engine = job.engine
        if engine is None or engine.state is None or job.probes is None:
            return None
        sync, final = engine.before_backward(self._logging.offset, sync_every_microbatch=job.config.sync_every_microbatch)
        self._gradient_sync(sync)
        if final and self._strategy.model is not None:
            return engine.start_overlap(_Runner(self, optimizer))  # type: ignore[arg-type]
        return None

    def _gradient_sync(self, sync: bool) -> None:
        model = self._strategy.model
        if sync != self._syncing and model is not None:
            set_gradient_sync(model, sync)
            self._syncing = sync

    def gradient_ready(self, index: int, grad: Tensor) -> None:
        """Backward finished parameter ``index``'s gradient (an overlapped reduction may send its bucket)."""
        engine = self._strategy.job.engine
        if engine is not None:
            engine.gradient_ready(index, grad)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        """The step's microbatches, the reduction until a membership commits, then the optimizer."""
        job, strategy = self._strategy.job, self._strategy
        assert job.engine is not None and job.probes is not None
        runner = _Runner(self, optimizer)
        with self._abandon_step_on_error():
            result = closure()  # training_step(ticket) -> first microbatch, zero_grad, backward
            self._logging.capture(job.engine)
            st = job.engine.state
            assert st is not None
            job.engine.run_planned(runner)
            job.engine.reduce_until_committed(runner)
            self._logging.apply(st.work.logged_totals, strategy.world_size)
            # on_before_optimizer_step and clipping must see the reduced gradient, as with stock strategies.
            _lightning.after_closure(strategy.precision_plugin, model, optimizer)
            job.probes.fault_point("optimizer", step=st.step)
            job.probes.tick()
            out = optimizer.step(**kwargs)
            self._committed(job.engine.finish())
        return result if result is not None else out

    def _committed(self, record: dict[str, Any]) -> None:
        job, strategy = self._strategy.job, self._strategy
        assert self.data is not None and job.comm is not None
        self.data.planner.advance(record["step"])
        # check-ledger fits its loss tolerance to it: bf16 rounds a recovered step's sum differently.
        record["precision"] = str(getattr(strategy.precision_plugin, "precision", "32-true"))
        self.last_record = record
        if job.ledger is not None:
            job.ledger.record(record, is_leader=strategy.global_rank == 0)
        self._logging.log_committed(
            record, live_replicas=len(job.comm.alive_replicas), world_epoch=job.comm.world_epoch, faults=strategy.faults_seen
        )

    @contextmanager
    def _abandon_step_on_error(self) -> Iterator[None]:
        """A step left by an exception (below min_replicas, a user error) is no longer computing."""
        try:
            yield
        except BaseException:
            engine = self._strategy.job.engine
            if engine is not None:
                engine.abandon()
            raise
