"""The step engine: one optimizer step of the recovery protocol, top to bottom.

The engine runs against four small contracts, so it needs neither Lightning nor MPI:

* a :class:`~lightning_recover.comm.interface.ReplicaComm` (ULFM in production, an
  in-process fake in tests);
* a :class:`MicrobatchRunner` that computes one step-local microbatch (forward and
  backward, accumulating into the gradients) and hands out the local gradient tensors;
* :class:`Probes` for what watches the step from outside (the hang watchdog, fault
  injection); they default to doing nothing;
* :class:`~lightning_recover.recovery.hooks.HookCalls`, the callbacks' recovery hooks as
  typed calls (none by default). The hooks that communicate get the engine's
  :class:`~lightning_recover.recovery.hooks.StepCollectives` as an argument, so a
  collective in a hook is repaired and retried like the engine's own.

One step, as every rank of every live replica runs it::

    begin(step)                      the policy plans the step for the live replicas
    run(runner, ...)                 compute this replica's planned microbatches (a framework
                                     that runs the first itself: start_planned, run_planned;
                                     before_backward says when to sync inside the replica);
                                     before the last one's backward, start_overlap(runner)
                                     (optional):
        on_before_overlap                callbacks may keep this step's reduction synchronous
        on_before_reduce                 callbacks pick what is sent and where sums land
        reduce in buckets                in a helper thread, each bucket once backward made it
    reduce_until_committed(runner)   loop:
        on_before_reduce                 callbacks pick what is sent and where sums land
        reduce in buckets                each bucket tagged with the world epoch (or: wait for
                                         the overlapped first round)
        agree                            all survivors get the same verdict
        on failure: repair               shrink to whole replicas, world epoch + 1
                    on_world_repaired    (each lost replica reported once)
                    policy.fail          promote a spare or replay the lost ids
                    on_boundary_step     callbacks schedule the extra microbatches
                    run them, then reduce the stale/pending buckets again
    on_before_commit                 every bucket is from the current world epoch
    sums / (B * shards) -> gradients (the caller then runs the optimizer)
    finish()                         the policy commits; the step's ledger record

Between two steps (after ``finish``, before the next ``begin``) replicas may re-join: once
the communicator has merged them into the world, every rank -- the joiners too, after
they received the live state -- calls ``admit(joins)``: the policy takes them in
(``WorkloadPolicy.join``), ``on_replicas_joined`` tells the callbacks, and the next step's
record lists them (``joined``, and ``joins`` with the transfer and pause seconds the
communicator measured; :meth:`StepEngine.note_join` fills them in later if the transfer
follows the admission). A step in progress never admits anyone: joins wait for the
boundary.

Overlap (:mod:`~.overlap`): with ``overlap=True`` the first reduction round starts before
the last planned backward and its buckets are reduced as backward produces them; a
failure in it is handled by the same loop (agree, repair, redo the stale buckets, now
synchronously). Buckets are planned over the gradients in reverse parameter order either
way, the order backward makes them.

Errors: a peer death is never an exception out of the engine (it becomes a repair); the
policy's ``TooFewReplicasError`` (below ``min_replicas``) and a callback's refusal in
``on_before_commit`` propagate to the caller, as does any error of the runner.
"""

from __future__ import annotations

import logging
import time
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from lightning_recover.comm.interface import PeerFailure, RepairResult, ReplicaComm
from lightning_recover.recovery import step_values
from lightning_recover.recovery.hooks import HookCalls, StepCollectives
from lightning_recover.recovery.overlap import HelperThread, OverlappedReduction
from lightning_recover.recovery.state import Join, Schedule, StepFailures, StepState
from lightning_recover.workload.policy import WorkloadPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")
_NO_PAYLOAD = torch.empty(0, dtype=torch.float64)


class _RoundSums(NamedTuple):
    """What a completed reduction round summed over the world, besides the gradient buckets."""

    #: The step's header (loss, counts, votes): :func:`~.step_values.header`.
    head: torch.Tensor
    #: The values logged with ``sync_dist``, in ``keys`` order (empty when none were).
    logged: torch.Tensor
    keys: list[str]
    #: The vote names, in the header's order.
    votes: list[str]


class MicrobatchRunner(Protocol):
    """Computes microbatches into the gradient accumulator (the strategy, or a test double)."""

    def run_microbatch(self, offset: int) -> None:
        """Forward and backward of step-local microbatch ``offset``; must call :meth:`StepEngine.record`."""

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's accumulated gradient tensors (local shards), in a fixed order."""


class Probes:
    """Watchers of a step; this base does nothing. The strategy plugs in the watchdog and fault injection."""

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Blocked on peers (in a collective): not the same as being stuck in compute."""
        yield

    def tick(self) -> None:
        """This rank made progress."""

    def set_computing(self, computing: bool) -> None:
        """This rank is (not) computing inside a step."""

    def fault_point(self, phase: str, *, step: int, microbatch: int | None = None, bucket: int | None = None) -> None:
        """A point where fault injection may kill, stop or wedge this process."""


class StepEngine:
    """Runs the recovery protocol's optimizer steps for one rank; see the module docstring."""

    def __init__(
        self,
        comm: ReplicaComm,
        policy: WorkloadPolicy,
        *,
        shards: int = 1,
        hooks: HookCalls | None = None,
        probes: Probes | None = None,
        on_repair: Callable[[RepairResult], None] | None = None,
        overlap: bool = False,
    ) -> None:
        self.comm = comm
        #: Start each step's first reduction round during its last backward (:meth:`start_overlap`).
        self.overlap = overlap
        self.policy = policy
        self.shards = shards
        #: The recovery hooks' callbacks (none by default).
        self.hooks = hooks or HookCalls()
        #: What a hook that communicates gets as an argument: this engine's communicator and run_collective.
        self.collectives = StepCollectives(comm, self.run_collective)
        self.probes = probes or Probes()
        self.on_repair = on_repair
        self.state: StepState | None = None
        #: Replicas lost since the engine started (in steps and in collectives between them).
        self.faults_seen = 0
        # Recovery pauses and failed rounds of collectives between steps; the next step's
        # record carries them, so no repair goes unaccounted in the ledger.
        self._carried_pauses: list[float] = []
        self._carried_detects: list[float] = []
        # Joins admitted since the last commit, by replica; the next step's record lists them.
        self._joins: dict[int, Join] = {}
        # Runs every step's overlapped round (one thread for the job, not one per step).
        self._helper = HelperThread()
        # Inside the step's planned run (start_planned .. run_planned), and its last microbatch.
        self._planned_phase = False
        self._final_offset = -1

    # ------------------------------------------------------------------ the step
    def begin(self, step: int) -> StepState:
        """Plan ``step`` for the live replicas; the state of the previous step is dropped."""
        plan = self.policy.begin_step(step, self.comm.alive_replicas)
        self.state = StepState(
            step=step, replica=self.comm.replica, plan=plan, started_at=time.perf_counter(), world_epoch=self.comm.world_epoch,
            failures=StepFailures(pauses=self._carried_pauses, detects=self._carried_detects),
        )
        self._carried_pauses, self._carried_detects = [], []
        self.probes.set_computing(True)
        return self.state

    def record(self, offset: int, loss: float) -> None:
        """The runner computed microbatch ``offset`` (its gradient is now accumulated)."""
        st = self._current()
        st.work.losses[offset] = loss
        st.work.computed.append(offset)

    def record_logged(self, offset: int, values: dict[str, step_values.Values]) -> None:
        """Values microbatch ``offset`` logged for a cross-replica sum at commit (:mod:`~.step_values`)."""
        self._current().work.logged[offset] = values

    def run(self, runner: MicrobatchRunner, offsets: Sequence[int]) -> None:
        for offset in offsets:
            runner.run_microbatch(offset)

    # The planned run: the step's planned microbatches, before any re-plan or recovery work.
    # Only inside it may a backward defer the in-replica reduce-scatter (see before_backward).
    def start_planned(self) -> int:
        """The step's planned microbatches start running; returns the first one's step-local id."""
        st = self._current()
        self._planned_phase, self._final_offset = True, st.mine.ids[-1]
        return st.mine.ids[0]

    def run_planned(self, runner: MicrobatchRunner) -> None:
        """The rest of the planned run, after the first microbatch; the planned run ends."""
        st = self._current()
        # A repair inside the first microbatch (a collective in training_step) re-planned the step: the
        # new plan's ids[1:] may hold the id just computed under the old one (its gradient would count
        # twice); the boundary step in reduce_until_committed runs exactly what is missing.
        self.run(runner, () if st.replan_pending else st.mine.ids[1:])
        self._planned_phase = False

    def before_backward(self, offset: int, *, sync_every_microbatch: bool) -> tuple[bool, bool]:
        """Microbatch ``offset``'s backward starts: returns (sync inside the replica now, it is the planned run's last).

        Deferring the in-replica reduce-scatter is safe only inside the planned run: a
        re-plan (or a recovery microbatch) may reset the accumulator, and FSDP2's pending
        unsharded gradient has no public way to be dropped, so from then on every backward
        syncs (which flushes what is pending). The last planned backward is where
        :meth:`start_overlap` belongs."""
        st = self._current()
        self.probes.fault_point("backward", step=st.step, microbatch=st.work.microbatches_run)
        self.probes.tick()
        st.work.microbatches_run += 1
        final = self._planned_phase and not st.replan_pending and offset == self._final_offset
        deferring = self._planned_phase and not st.replan_pending and not sync_every_microbatch
        return final or not deferring, final

    def start_overlap(self, runner: MicrobatchRunner) -> OverlappedReduction | None:
        """Before the step's last planned backward: start reducing buckets as backward makes them.

        Returns the reduction in flight (tell it :meth:`OverlappedReduction.mark_ready` per
        finished gradient, in :meth:`plane_index` terms) or None when this step reduces
        after backward: overlap off, a re-plan pending, or an ``on_before_overlap`` callback
        set ``step.reduction.overlap = False``. Call it at most once per step.
        """
        st = self._current()
        if not self.overlap or st.replan_pending or st.reduction.handle is not None:
            return None
        self.hooks.before_overlap(st)
        if not st.reduction.overlap:
            return None
        self._prepare_reduction(runner)
        self.hooks.before_reduce(st, self.collectives)
        if st.requests.redo is not None:
            raise RuntimeError(
                "a callback asked to redo microbatches (step.requests.redo) before the last backward ran; a callback that "
                "checks the whole local gradient must set step.reduction.overlap = False in on_before_overlap"
            )
        st.reduction.overlapped = True
        st.reduction.inflight = OverlappedReduction(
            self.comm, st.reduction.send[::-1], st.reduction.out[::-1], st.reduction.handle,
            before_bucket=self._overlapped_bucket, after_bucket=self._after_bucket,
            # A round left running by an abandoned step (an exception) keeps the engine's helper busy: this one gets its own.
            helper=self._helper if self._helper.idle else None,
        )
        return st.reduction.inflight

    def plane_index(self, index: int) -> int:
        """Where gradient ``index`` (of ``runner.local_grads()``) sits in the reduction's plane order."""
        return len(self._current().reduction.local) - 1 - index

    def gradient_ready(self, index: int, tensor: Any) -> None:
        """Backward made gradient ``index`` final, in ``tensor``: the overlapped round may reduce it.

        A no-op unless a round is in flight. ``tensor`` is the gradient's current local
        tensor (backward may have replaced the one :meth:`start_overlap` saw).
        """
        st = self.state
        if st is None or st.reduction.inflight is None:
            return
        st.reduction.local[index] = tensor
        # A spare sends zeros (its output, in place); its gradient only stays for a promotion.
        st.reduction.inflight.mark_ready(self.plane_index(index), tensor if st.mine.contributes else None)

    def _prepare_reduction(self, runner: MicrobatchRunner) -> None:
        st = self._current()
        if st.reduction.handle is None:
            st.reduction.local = runner.local_grads()
            # Reverse parameter order: the order backward produces the gradients, so with
            # overlap the first bucket is the first one ready.
            st.reduction.handle = self.comm.plan(st.reduction.local[::-1])

    def reduce_until_committed(self, runner: MicrobatchRunner) -> int:
        """Reduce, agree, and on failure repair and recompute until one membership commits.

        On return the gradients hold the committed sums divided by ``B * shards``; the
        return value is the policy's divisor (B for the static policy).
        """
        st = self._current()
        self._prepare_reduction(runner)
        failed_at: float | None = None
        while True:
            if not self._ready_to_reduce(runner, st):
                continue
            round_started = time.perf_counter()
            sums = self._reduce_round(runner, st)
            with self.probes.waiting():
                committed = self.comm.agree(sums is not None)
            if committed:
                assert sums is not None, "an agreed round is one every member, this one too, completed"
                st.agreed = True
                break
            # The time blocked in a failed round (reduce + agreement) bounds how long a hung
            # peer went unnoticed; the agreement counts too, since a peer that hangs after
            # the others saw a death blocks them there.
            st.failures.detects.append(time.perf_counter() - round_started)
            if failed_at is None:
                failed_at = time.perf_counter()
            self._recover(runner)
        # The agreed sums first: on_before_commit callbacks decide on them (BufferSync reads
        # its vote there; read before they were set, every step looked like a buffer change).
        st.work.loss = float(sums.head[0]) / max(1.0, float(sums.head[1]))
        st.work.logged_totals = step_values.unpack(sums.logged, sums.keys)
        st.requests.vote_totals = {k: float(v) for k, v in zip(sums.votes, sums.head[5:])}
        self.hooks.before_commit(st)
        if failed_at is not None:
            st.failures.pauses.append(time.perf_counter() - failed_at)
        # Constant divisor: B microbatches (times the shards, whose FSDP reduce-scatter sums),
        # never the number of survivors.
        divisor = st.plan.divisor * self.shards
        for grad, total in zip(st.reduction.local, st.reduction.out):
            grad.copy_(total).div_(divisor)
        return st.plan.divisor

    def _ready_to_reduce(self, runner: MicrobatchRunner, st: StepState) -> bool:
        """A repair inside the step re-plans it first; then the callbacks' ``on_before_reduce``. False when a
        callback asked for microbatches to be computed again (done here): the round is prepared anew."""
        if st.replan_pending:
            st.replan_pending = False
            self._abandon_inflight()
            self._boundary(runner)
        if st.reduction.inflight is None:
            self.hooks.before_reduce(st, self.collectives)
        if st.requests.redo is None:
            return True
        # A callback found this step's gradients suspect (a corruption cross-check):
        # recompute the ids it named from a fresh accumulator, then check again.
        redo, st.requests.redo = st.requests.redo, None
        if redo:
            self._run_schedule(runner, Schedule(True, redo))
        return False

    def _reduce_round(self, runner: MicrobatchRunner, st: StepState) -> _RoundSums | None:
        """One reduction round in the current membership: the gradient buckets, then the step's header (loss,
        counts, votes) and the values logged with ``sync_dist``. None when a peer failed during it."""
        mine = st.mine
        owned = mine.ids if mine.contributes else ()
        keys = step_values.keys_of(st.work.logged)
        votes = sorted(st.requests.votes)
        head_in = step_values.header(sum(st.work.losses[i] for i in owned), len(owned), keys, [st.requests.votes[k] for k in votes])
        head_out = torch.empty_like(head_in)
        # Nothing logged with sync_dist (the common step): no payload to build or reduce.
        logged_in = step_values.payload(st.work.logged, owned, keys) if keys else _NO_PAYLOAD
        logged_out = torch.empty_like(logged_in) if keys else _NO_PAYLOAD
        try:
            if st.reduction.inflight is not None:
                inflight, st.reduction.inflight = st.reduction.inflight, None
                with self.probes.waiting():
                    inflight.join(set_computing=self.probes.set_computing)
                self._check_overlapped(runner, inflight)
            with self.probes.waiting():
                self.comm.allreduce(
                    st.reduction.send[::-1], st.reduction.out[::-1], handle=st.reduction.handle,
                    on_bucket=self._before_bucket, after_bucket=self._after_bucket,
                )
                self.comm.allreduce([head_in], [head_out], across="world")
                self._check_counted(head_out)
                step_values.check_header(head_out, keys)
                if keys:
                    self.comm.allreduce([logged_in], [logged_out], across="world")
        except PeerFailure as exc:
            log.warning("step %d: %s", st.step, exc)
            return None
        return _RoundSums(head_out, logged_out, keys, votes)

    def _check_counted(self, head_out: torch.Tensor) -> None:
        """Every world member's header is in the sum (each counts 1), else the reduction was cut short.

        Open MPI 5.0.x's non-blocking collectives can complete on a survivor although a peer
        died or the world was revoked during them (libnbc prints "aborting the schedule"):
        seen on fake hosts, where a replica's surviving mate then read a half-reduced header
        as the user's logging mistake. Such a round failed; the agreement that follows
        fails it for everyone and the repair sees who died."""
        counted, members = float(head_out[2]), len(self.comm.members)
        if counted != members:
            raise PeerFailure((), f"the step header's reduction (it counted {counted:g} of the world's {members} ranks: cut short by a failure)")

    def finish(self) -> dict[str, Any]:
        """After ``optimizer.step``: the policy commits; returns the step's ledger record and ends the step."""
        st = self._current()
        self.probes.set_computing(False)  # between steps nothing counts as stuck
        commit = self.policy.commit()
        record = commit.as_dict()
        died = set(commit.died)
        record.update(
            loss=st.work.loss,
            world_epoch=self.comm.world_epoch,
            step_time_s=time.perf_counter() - st.started_at,
            recovery_s=st.recovery_s,
            pauses_s=st.failures.pauses,
            detect_s=sum(st.failures.detects),
            detects_s=st.failures.detects,
            stale_buckets=st.failures.stale_buckets_redone,
            overlapped=st.reduction.overlapped,
            policy=self.policy.name,
            divisor=st.plan.divisor,
            # ok: the joiner is still there at the commit (one dead by then is also among the faults).
            joins=[{**self._joins.get(r, Join(r)).as_dict(), "ok": r in commit.membership and r not in died} for r in commit.joined],
        )
        self._joins = {}
        self.state = None
        self.hooks.step_committed(record, self.collectives)
        return record

    # ------------------------------------------------------------------ re-join
    def admit(self, joins: Iterable[int | Join]) -> tuple[Join, ...]:
        """Between steps: replicas the communicator merged into the world join the policy.

        ``joins`` are replica indices or :class:`Join` (with the measured timings). Every
        rank calls it with the same replicas at the same boundary, joiners included (after
        loading the state a survivor sent). A joiner that takes the index of a replica the
        policy still counts as live replaces one whose loss was seen only between steps
        (a repair outside any step): that loss is recorded too, as the next step's fault.
        Returns the joins; the callbacks' ``on_replicas_joined`` hears of them.
        """
        if self.state is not None:
            raise RuntimeError(
                f"admit() during step {self.state.step}: replicas join at a step boundary; call "
                f"admit() after finish() and before the next begin() (a joiner ready mid-step waits)"
            )
        admitted = tuple(j if isinstance(j, Join) else Join(j) for j in joins)
        if not admitted:
            return ()
        replicas = [j.replica for j in admitted]
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"admit(): replica listed twice in {replicas}; pass each joiner once")
        missing = sorted(set(replicas) - set(self.comm.alive_replicas))
        if missing:
            raise ValueError(
                f"admit(): replica(s) {missing} are not in the communicator's world "
                f"(alive: {list(self.comm.alive_replicas)}); merge them into the world first"
            )
        self.policy.join(replicas, lost=set(replicas) & set(self.policy.live))
        for j in admitted:
            self._joins[j.replica] = j
        self.hooks.replicas_joined(admitted, self.policy.next_step)
        return admitted

    def note_join(self, replica: int, *, transfer_s: float | None = None, pause_s: float | None = None) -> None:
        """Timings of an admitted join measured after ``admit`` (e.g. the state transfer that follows it)."""
        if replica not in self._joins:
            raise ValueError(
                f"note_join(): replica {replica} was not admitted since the last commit "
                f"(pending joins: {sorted(self._joins)}); call admit() first"
            )
        j = self._joins[replica]
        self._joins[replica] = dataclasses.replace(
            j,
            transfer_s=j.transfer_s if transfer_s is None else transfer_s,
            pause_s=j.pause_s if pause_s is None else pause_s,
        )

    # ------------------------------------------------------------------ recovery
    def _recover(self, runner: MicrobatchRunner) -> None:
        """Repair the world, let the policy re-plan, compute this replica's extra microbatches."""
        with self.probes.waiting():
            res = self.comm.repair()
        self.repaired(res)
        self._current().plan = self.policy.fail(res.lost_replicas)
        self._boundary(runner)

    def _boundary(self, runner: MicrobatchRunner) -> None:
        """Run what the re-planned step asks of this replica (callbacks decide, see on_boundary_step)."""
        st = self._current()
        st.requests.schedule = None
        self.hooks.boundary_step(st)
        if st.requests.schedule is None:
            raise RuntimeError(
                "no recovery callback scheduled the boundary step (step.requests.schedule is None); keep "
                "lightning_recover.callbacks.BoundaryScheduler in trainer.callbacks"
            )
        self._run_schedule(runner, st.requests.schedule)

    def _run_schedule(self, runner: MicrobatchRunner, schedule: Schedule) -> None:
        st = self._current()
        if schedule.reset:
            for grad in runner.local_grads():
                grad.zero_()
            st.work.computed, st.work.losses, st.work.logged = [], {}, {}
        self.run(runner, schedule.run)

    def repaired(self, res: RepairResult) -> None:
        """Account a repair (in a step or between steps) and tell the callbacks, once per repair."""
        if self.state is not None:
            self.state.world_epoch = res.world_epoch
            self.state.failures.lost_replicas.extend(res.lost_replicas)
        self.faults_seen += len(res.lost_replicas)
        if self.on_repair is not None:
            self.on_repair(res)
        self.hooks.world_repaired(res, self.state)

    def run_collective(self, fn: Callable[[], T]) -> T:
        """Run a collective outside the step; if a peer dies, repair and retry until one membership agrees.

        The policy learns of the loss at the next ``begin`` (the new membership is in
        ``comm.alive_replicas``); that step's record carries the pause.
        """
        if self.state is not None:
            # One thread issues collectives at a time: a collective after the overlap started
            # (user code in a backward hook) first waits for the overlapped round.
            self._abandon_inflight()
        # Inside a step (a metric sync in training_step) the step's own record takes the
        # pause; between steps the next step's record does.
        pauses, detects = (self.state.failures.pauses, self.state.failures.detects) if self.state is not None else (
            self._carried_pauses, self._carried_detects
        )
        failed_at: float | None = None
        while True:
            round_started = time.perf_counter()
            with self.probes.waiting():
                try:
                    result, ok = fn(), True
                except PeerFailure:
                    result, ok = None, False
                if self.comm.agree(ok):
                    break
                detects.append(time.perf_counter() - round_started)
                failed_at = time.perf_counter() if failed_at is None else failed_at
                res = self.comm.repair()
            self.repaired(res)
            st = self.state
            if st is not None and not st.agreed and res.lost_replicas:
                # Lost inside a step before its sum was agreed: re-plan now (so nothing of the
                # lost replica is committed), compute the extra work just before reducing.
                st.plan = self.policy.fail(res.lost_replicas)
                st.replan_pending = True
        if failed_at is not None:
            pauses.append(time.perf_counter() - failed_at)
        return result  # type: ignore[return-value]

    def _check_overlapped(self, runner: MicrobatchRunner, inflight: OverlappedReduction) -> None:
        """After the overlapped round: redo it if backward left a gradient where the round never looked.

        A gradient tensor replaced during backward without its ready signal (a hook that did
        not fire) was sent from the old tensor: that sum is wrong, so the round is redone
        synchronously from the final gradients (slower, never wrong).
        """
        st = self._current()
        fresh = runner.local_grads()
        moved = [i for i, t in enumerate(fresh) if t.data_ptr() != st.reduction.local[i].data_ptr()]
        st.reduction.local = fresh
        if not moved:
            return
        log.warning(
            "step %d: %d gradient tensor(s) were replaced during backward without a ready signal; "
            "the overlapped reduction is redone after backward", st.step, len(moved),
        )
        for bucket in inflight.handle.buckets:
            bucket.world_epoch = None
        self.hooks.before_reduce(st, self.collectives)

    def _abandon_inflight(self) -> None:
        """Wait out an overlapped round and mark it to be redone (its plan changed, or another collective must run)."""
        st = self._current()
        if st.reduction.inflight is None:
            return
        inflight, st.reduction.inflight = st.reduction.inflight, None
        try:
            with self.probes.waiting():
                inflight.join(set_computing=self.probes.set_computing)
        except PeerFailure:
            pass
        # Redo the whole round: the next on_before_reduce may reset the outputs (a spare's).
        for bucket in inflight.handle.buckets:
            bucket.world_epoch = None

    def abandon(self) -> None:
        """Forget a step left by an exception (below ``min_replicas``, a user error)."""
        if self.state is not None and self.state.reduction.inflight is not None:
            self.state.reduction.inflight.all_ready()  # never leave the helper waiting for a backward that is gone
        self.state = None
        self.probes.set_computing(False)

    # ------------------------------------------------------------------ bucket probes
    def _before_bucket(self, index: int) -> None:
        # Between the MPI waits of two buckets this rank runs its own code: that counts.
        self.probes.set_computing(True)
        self.probes.fault_point("reduce", step=self._current().step, bucket=index)
        self.probes.tick()
        self.probes.set_computing(False)

    def _overlapped_bucket(self, index: int) -> None:
        # In the overlap's helper thread: the main thread owns the computing flag meanwhile.
        self.probes.fault_point("reduce", step=self._current().step, bucket=index)
        self.probes.tick()

    def _after_bucket(self, index: int) -> None:
        self.hooks.bucket_reduced(self._current(), index, self.comm.world_epoch)

    def _current(self) -> StepState:
        if self.state is None:
            raise RuntimeError("no step in progress: call StepEngine.begin(step) first")
        return self.state
