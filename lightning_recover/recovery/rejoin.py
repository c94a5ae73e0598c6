"""Admission: the re-join protocol as a running :class:`~lightning_recover.recovery.job.RecoveryJob` runs it.

:mod:`lightning_recover.membership` has the pieces (the recruiter, the GO/abort handshake, the
state transfer); this module runs them at the points of a training job:

* every rank, once, before the first step: :func:`sync_initial_state` (every replica
  starts from the lowest replica's weights);
* survivors, at every step boundary: :func:`step_boundary` gives the recruiter its turn and,
  when replacements are ready, :func:`admit` grows the world and the donor replica sends
  them its checkpoint of this moment;
* a replacement, in its setup: :func:`join_world` waits for the survivors' GO, grows the
  world with them, receives the state and takes the protocol's part over
  (:meth:`RecoveryJob.take_over`); :func:`first_step` marks it a member like any other.

The framework's checkpoint comes in as callables: ``dump()`` returns what the framework
would save at this moment, its protocol state (under ``state_key``) included, and
``restore(checkpoint)`` hands a received one to the framework to load after setup. So
this module needs neither Lightning nor the trainer.

Errors: a replacement that cannot join ends through :func:`lightning_recover.membership.handshake.give_up` (its own exit);
a survivor's transfer runs as one collective of the engine (a death there is repaired,
the attempt dropped); a replica-mate's death during the send ends the replica through
``guard`` (the strategy's ``replica_guard``, fate ``gate``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from lightning_recover.membership import handshake, milestones
from lightning_recover.membership.recruiter import JoinAttempt
from lightning_recover.membership.seat import Joining
from lightning_recover.membership.transfer import donor_and_recipients, recv_state, send_state
from lightning_recover.recovery.job import RecoveryJob
from lightning_recover.recovery.state import Join
from lightning_recover.runtime import lifecycle

__all__ = ["admit", "first_step", "join_world", "step_boundary", "sync_initial_state"]

log = logging.getLogger(__name__)

#: A replica-local section that ends the replica through the gate if a replica-mate dies in it.
Guard = Callable[[str], AbstractContextManager[None]]


def sync_initial_state(job: RecoveryJob, tensors: list[torch.Tensor]) -> None:
    """Every replica starts from the lowest replica's weights, seeded or not (``tensors``: this shard's)."""
    assert job.comm is not None and job.engine is not None
    comm = job.comm
    if job.probes is not None:
        job.probes.fault_point("first_broadcast", step=0)
    job.engine.run_collective(lambda: comm.broadcast_tensors(tensors, root=0))


def join_world(
    job: RecoveryJob, joining: Joining, *, mesh: Any, device: torch.device, state_key: str,
    restore: Callable[[dict[str, Any]], None],
) -> None:
    """A replacement: wait for the survivors' GO, grow the world with them, receive the live state.

    The state is the donor replica's checkpoint (``mesh``/``device``: where its sharded
    tensors land); ``restore`` hands it to the framework, which loads it right after setup
    as it loads a checkpoint file; the policy and planner are taken over as on a resume."""
    from lightning_recover.membership import admission_timer

    assert job.comm is not None and job.engine is not None and job.layout is not None and job.probes is not None
    probes = job.probes
    probes.fault_point("join_startup", step=joining.seat.attempt)
    milestones.mark("ready")
    while True:
        if joining.link is not None:
            # A standby's replacement: merged only now, so that a loss among the survivors while
            # its script set up never cost it its seat.
            with probes.waiting():
                if not handshake.connect(joining):
                    handshake.give_up(joining, "the leader that spawned this standby is gone or training ended")
        attempt = joining.seat.attempt
        with probes.waiting():
            decision = handshake.await_admission(joining, lambda: probes.fault_point("join_ready", step=attempt))
        if decision == "go":
            if job.comm.grow(joining.merged):
                break
            why = "a member died while the world grew"
        else:
            why = "the survivors dropped this re-join attempt or finished training"
        if decision == "abort" or joining.link is None:
            handshake.give_up(joining, why)
        # A standby's replacement whose attempt the survivors' own repair dropped asks again.
        joining.merged = None
        admission_timer.restart_timer()
    milestones.mark("go")
    admission_timer.admitted()
    lifecycle.start_rank(job.comm.rank, job.layout.world_size, end_of_job=job.host.end_of_job)
    job.host.on_ranks()
    replicas = sorted({job.layout.replica_of(r) for r in joining.seat.ranks})
    comm, layout = job.comm, job.layout
    started = time.perf_counter()

    def receive() -> dict[str, Any]:
        live = [r for r in replicas if r in comm.alive_replicas]
        donor, _ = donor_and_recipients(comm, live)
        source = comm.members.index(layout.rank_of(donor, comm.shard))
        probes.fault_point("join_transfer", step=attempt)
        return recv_state(comm, source, mesh, device)

    checkpoint = job.engine.run_collective(receive)
    milestones.mark("state")
    job.take_over(checkpoint[state_key])
    job.engine.admit([Join(r) for r in replicas if r in comm.alive_replicas])
    if job.recruiter is not None:
        job.recruiter.joined_at(joining.seat.attempt)
    restore(checkpoint)
    log.info("joined as rank %d after %.2f s of state transfer", comm.rank, time.perf_counter() - started)


def first_step(job: RecoveryJob) -> None:
    """A replacement's first step: from here on it is a member like any other."""
    assert job.joining is not None and job.probes is not None
    job.probes.fault_point("joined", step=job.joining.seat.attempt)
    milestones.mark("first_step")
    seat = job.joining.seat
    lost_at = seat.context.get("lost_at")
    print(f"[lightning-recover] replacement for rank {job.comm.rank if job.comm else '?'} (attempt {seat.attempt}) "
          f"starts its first step: {milestones.breakdown(seat.spawned_at, lost_at if isinstance(lost_at, float) else None)}",
          file=sys.stderr, flush=True)
    job.joining = None


def step_boundary(job: RecoveryJob, batch_idx: int, *, dump: Callable[[], dict[str, Any]], guard: Guard) -> None:
    """The step boundary of hot re-join on the survivors: the recruiter's turn, and an admission when one is ready."""
    if job.recruiter is None or job.engine is None or job.joining is not None:
        return
    recruiter = job.recruiter
    recruiter.tend()  # the leader's standbys: never blocks
    # Never at an epoch's first step: the framework would restore the replacement's loop into the previous epoch.
    attempt = job.engine.run_collective(lambda: recruiter.boundary(can_admit=batch_idx > 0))
    if attempt is not None:
        admit(job, attempt, dump=dump, guard=guard)


def admit(job: RecoveryJob, attempt: JoinAttempt, *, dump: Callable[[], dict[str, Any]], guard: Guard) -> None:
    """Survivors: grow the world with the ready replacements and send them the live state.

    ``dump()``: the framework's checkpoint of this moment with the protocol's state, sent by the donor replica."""
    assert job.recruiter is not None and job.engine is not None and job.comm is not None and job.probes is not None
    comm, probes = job.comm, job.probes
    started = time.perf_counter()
    if not job.recruiter.admit(attempt):
        return
    grown = time.perf_counter()

    def live() -> list[int]:
        return [r for r in attempt.replicas if r in comm.alive_replicas]

    def transfer() -> None:
        donor, to = donor_and_recipients(comm, live())
        if comm.replica == donor:
            probes.fault_point("join_transfer", step=attempt.number)
            checkpoint = dump()
            with guard("state transfer"):
                send_state(comm, checkpoint, to[comm.shard])

    job.engine.run_collective(transfer)
    done = time.perf_counter()
    joins = job.engine.admit([Join(r, transfer_s=done - grown, pause_s=done - started, spawned=attempt.spawned) for r in live()])
    job.host.on_membership()
    lost_at = job.recruiter.lost_at
    since = "" if lost_at is None else f"; {time.time() - lost_at:.2f} s after the loss"
    if job.global_rank == 0 and not joins:
        # Every replacement of the attempt died while the state reached it: the repair has said so; no join to report.
        print(
            f"[lightning-recover] world epoch {comm.world_epoch}: re-join attempt {attempt.number} lost its replacement(s) "
            f"of replica(s) {list(attempt.replicas)} during the state transfer; alive {list(comm.alive_replicas)}",
            file=sys.stderr, flush=True,
        )
    elif job.global_rank == 0:
        print(
            f"[lightning-recover] world epoch {comm.world_epoch}: replica(s) {[j.replica for j in joins]} re-joined "
            f"(state transfer {done - grown:.2f} s, survivors paused {done - started:.2f} s{since}); alive {list(comm.alive_replicas)}",
            file=sys.stderr, flush=True,
        )
