"""RecoveryJob: the running job of one rank -- what the strategy starts, resumes, re-joins and closes.

The strategy (:mod:`lightning_recover.strategies.recover_hsdp`) only adapts Lightning's
hooks; everything a rank *owns* while the recovery protocol runs lives in one
:class:`RecoveryJob`: the ULFM communicator and rank layout, the workload policy, the step
engine, the hang watchdog and probes, the replica-local process groups, the step ledger
and the re-join recruiter. The job imports no Lightning: what it needs of the trainer
arrives through one :class:`JobBridge`.

Lifecycle (one job per process, started once; a resume per ``fit`` from a checkpoint, a
re-join only on a replacement)::

    build    RecoveryJob(config)             settings only; nothing is started
    start    start(host)                     a launched rank: MPI, crash hook, checks,
                                             communicator, then the protocol (below)
             start_replacement(joining, host) a replacement spawned by the recruiter:
                                             the same, without any survivor; it is a
                                             member only after the re-join (below)
             (both) policy, watchdog, replica-local group, engine, ledger, recruiter;
                    standbys start at once on the launched ranks
    resume   load_state_dict(state)          a checkpoint's protocol state (B, G_init, T,
                                             seed, sample order) rebuilds the policy for
                                             today's replicas; state_dict() is what a
                                             checkpoint or a donor's transfer carries
    re-join  take_over(state)                a replacement takes a donor's protocol state
                                             (:mod:`lightning_recover.recovery.rejoin`
                                             runs the exchange itself)
    close    close()                         the survivors' last agreement (repairing a
                                             death after the last commit), the watchdog
                                             stops; shutdown(exit_code) then ends the rank
                                             (at interpreter exit the host's end_of_job
                                             runs it, registered by start)

Errors (one table for the package: :mod:`lightning_recover.errors`; the fates named here
are its fates):

* Before the first step every refusal is a ``ConfigurationError`` (fate ``user``) that
  names the bad value and the fix: several devices per process, a world that does not
  fit the settings, a data or replica plane this process cannot run, a checkpoint whose
  B the configured policy cannot keep on today's replicas. ``ULFMUnavailableError``
  (``user``) comes from the communicator when the MPI has no fault tolerance.
* A peer's death during a collective (``PeerFailure``) never leaves the job: the engine
  repairs (``repaired``), :meth:`RecoveryJob.on_repair` moves leadership and drops a
  re-join attempt the repair overtook.
* A replica-mate's death inside the replica ends this replica through the gate
  (``gate``; the strategy's ``replica_guard``).
* Fewer live replicas than ``min_replicas`` (``TooFewReplicasError``, ``stop``) reaches
  the script, which ends the rank with ``shutdown(exit_code=3)``; :meth:`shutdown`
  leaves without ``MPI_Finalize`` and the launcher reads a deliberate stop.
* A replacement that cannot join gives up through :func:`lightning_recover.membership.handshake.give_up`
  (its own exit; the survivors never wait on it).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_recover.audit.ledger_writer import LeaderLedger
from lightning_recover.comm.communicator import FaultTolerantComm
from lightning_recover.comm.data_plane import check_data_plane
from lightning_recover.comm.interface import RepairResult
from lightning_recover.comm.process_group import ProcessGroupULFM, lockstep_refusal, new_replica_group
from lightning_recover.comm.replica_plane import resolve_replica_plane
from lightning_recover.comm.topology import RankLayout
from lightning_recover.comm.ulfm import failure_classes
from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.membership import milestones
from lightning_recover.membership.recruiter import Recruiter
from lightning_recover.membership.seat import Joining, job_environ
from lightning_recover.recovery.engine import Probes, StepEngine
from lightning_recover.recovery.hooks import HookCalls
from lightning_recover.runtime import lifecycle
from lightning_recover.runtime.watchdog import HangWatchdog, default_hang_timeout
from lightning_recover.workload.factory import make_policy
from lightning_recover.workload.policy import WorkloadPolicy

__all__ = ["JobBridge", "RecoveryJob"]


def _failed_world_ranks() -> list[int]:
    """The ranks of ``COMM_WORLD`` this rank knows dead (ULFM's ``Get_failed``); [] when it cannot tell."""
    from mpi4py import MPI

    try:
        world = MPI.COMM_WORLD
        failed = world.Get_failed()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), world.Get_group())
        return sorted(int(r) for r in ranks if r != MPI.UNDEFINED)
    except (MPI.Exception, AttributeError, NotImplementedError):
        return []


class JobBridge(Protocol):
    """What the job needs of the framework that runs it (Lightning, through the strategy): one object.

    Given at the start (the trainer exists by then); each method is asked when its answer is
    needed, never cached. :class:`~lightning_recover.strategies.trainer_setup.LightningBridge`
    is Lightning's."""

    #: The recovery hooks, called on the framework's callbacks (:class:`lightning_recover.recovery.hooks.HookCalls`).
    hooks: HookCalls

    def device_type(self) -> str:
        """The device type this process computes on (``"cuda"``, ``"cpu"``): picks the planes and the backend."""
        ...

    def devices(self) -> int:
        """How many devices the framework was asked to drive from this process (must be 1)."""
        ...

    def make_probes(self, rank: int, watchdog: HangWatchdog | None) -> Probes:
        """The probes for original world rank ``rank`` and the watchdog (None without one)."""
        ...

    def step(self) -> int:
        """The trainer's global step (the replica group's failure messages name it)."""
        ...

    def logger_versions(self) -> list[Any]:
        """The loggers' versions (a replacement resolves the same run directories)."""
        ...

    def evaluating(self) -> bool:
        """Inside an evaluation batch (ranks evaluate different numbers: no lockstep collectives)."""
        ...

    def on_ranks(self) -> None:
        """This rank's place in the world changed: the framework's rank-zero gates follow."""
        ...

    def on_membership(self) -> None:
        """A repair changed the world (before the recruiter hears of it): logging follows."""
        ...

    def init_replica_group(
        self, comm: FaultTolerantComm, shards: int, timeout_s: float, backend: str, *, gather: Callable[[Any], list[Any]]
    ) -> None:
        """Builds torch's replica-local default group (``strategies.replica_group.init_replica_group``)."""
        ...

    def end_of_job(self) -> None:
        """What the interpreter's exit runs at the end of the job (the strategy's ``shutdown``)."""
        ...


class RecoveryJob:
    """One rank's running job; see the module docstring for its lifecycle and errors."""

    def __init__(self, config: RecoverConfig) -> None:
        self.config = config
        self._host: JobBridge | None = None
        launcher_default = default_hang_timeout() if config.hang_timeout_s is None else None
        self.hang_timeout_s, self.stuck_timeout_s = config.watchdog_timeouts(launcher_default)
        self.comm: FaultTolerantComm | None = None
        self.layout: RankLayout | None = None
        self.policy: WorkloadPolicy | None = None
        self.engine: StepEngine | None = None
        self.watchdog: HangWatchdog | None = None
        self.probes: Probes | None = None
        self.ledger: LeaderLedger | None = None
        self.recruiter: Recruiter | None = None
        self.replica_group: ProcessGroupULFM | None = None
        #: This replica's ranks on MPI (rank = shard index).
        self.mates: Any = None
        #: What carries FSDP2's collectives inside the replica, settled at the start.
        self.replica_plane = "torch"
        #: This process is a replacement that has not run its first step yet: the survivors are
        #: past the setup-time collectives it would otherwise ask them for.
        self.joining: Joining | None = None
        #: The protocol state a resume or a re-join continues from (the data planner loads it).
        self.resumed: dict[str, Any] | None = None

    @property
    def host(self) -> JobBridge:
        """What the framework lent the job at its start."""
        if self._host is None:
            raise RuntimeError("the job has no host before start(host) or start_replacement(joining, host)")
        return self._host

    @property
    def global_rank(self) -> int:
        """The rank in the current world (a replacement not admitted yet is nobody's rank zero)."""
        assert self.comm is not None
        return self.comm.layout.world_size if self.comm.world is None else self.comm.world_rank

    # ------------------------------------------------------------------ start
    def start(self, host: JobBridge) -> None:
        """This rank joins the job: MPI, crash handling, the communicator, the policy, the replica-local group, the engine."""
        self._host = host
        lifecycle.prepare_mpi()
        lifecycle.mark_init()  # before MPI_Init: a rank lost at start is named with its host
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            # First, so that every check below that raises ends the rank the way the launcher reports (lifecycle).
            lifecycle.install_crash_hook(MPI.COMM_WORLD.Get_rank())
        elif not lifecycle.launched():
            lifecycle.warn_single_replica()
        self._refuse_several_devices()
        self.config.check_world(MPI.COMM_WORLD.Get_size())
        self._check_planes()
        self.layout = RankLayout(MPI.COMM_WORLD.Get_size(), self.config.shards)
        try:
            self.comm = FaultTolerantComm(
                self.layout, bucket_bytes=self.config.bucket_bytes, data_plane=self.config.data_plane, plane_timeout_s=self.config.timeout_s
            )
            self.comm.salvage = self.config.salvaging
            mates = self.comm.world.Split(self.comm.replica, self.comm.shard)
        except MPI.Exception as exc:
            # A peer died after MPI_Init but before the communicator existed (during its imports,
            # before it reached the strategy): there is nothing to repair yet, and the world is
            # fixed when MPI starts, so this launch ends with one line instead of a traceback per rank.
            if exc.Get_error_class() not in failure_classes():
                raise
            lifecycle.lost_at_start(MPI.COMM_WORLD.Get_rank(), _failed_world_ranks(), "before the communicator came up")
        # The script's end runs `shutdown()` by itself at interpreter exit; no call needed.
        lifecycle.start_rank(self.comm.rank, self.layout.world_size, end_of_job=self.host.end_of_job)
        self._start_protocol(mates)

    def start_replacement(self, joining: Joining, host: JobBridge) -> None:
        """This process replaces a lost rank: everything of :meth:`start` that needs no survivor.

        It becomes a member of the world in the strategy's ``setup``
        (:func:`lightning_recover.recovery.rejoin.join_world`), once its model and
        optimizer exist to receive the live state."""
        self._host = host
        milestones.mark("strategy")
        lifecycle.install_crash_hook(joining.rank)
        self._refuse_several_devices()
        self._check_planes()
        self.layout = layout = RankLayout(int(joining.seat.context["world_size"]), self.config.shards)
        self.comm = FaultTolerantComm.joiner(
            layout, joining.rank, bucket_bytes=self.config.bucket_bytes, data_plane=self.config.data_plane,
            plane_timeout_s=self.config.timeout_s,
        )
        self.comm.salvage = self.config.salvaging  # a seated orphan may be orphaned again (FaultTolerantComm.joiner)
        self.joining = joining
        # The replica-local group among this replica's replacements (all spawned together).
        mates = joining.children.Split(layout.replica_of(joining.rank), layout.shard_of(joining.rank))
        # The survivors' heartbeat directory: this process belongs to another MPI job id.
        beats = joining.seat.context.get("heartbeats")
        self._start_protocol(mates, heartbeats=Path(beats) if beats else None)

    def _check_planes(self) -> None:
        """Refuse a data or replica plane this process cannot run; settle ``replica_plane=auto``."""
        device = self.host.device_type()
        check_data_plane(self.config.data_plane, device)
        self.replica_plane = resolve_replica_plane(self.config.replica_plane, self.config.data_plane, device)

    def _refuse_several_devices(self) -> None:
        """One process drives one device here; Trainer(devices=N) would otherwise be silently ignored."""
        devices = self.host.devices()
        if devices > 1:
            script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script.py"
            raise ConfigurationError(
                f"Trainer(devices={devices}) with ReCoVerHSDPStrategy: each process drives one device; "
                f"set Trainer(devices=1) and start one process per device: lightning-recover launch -n N -- python {script}"
            )

    def _start_protocol(self, mates: Any, heartbeats: Path | None = None) -> None:
        """What every rank builds once it has its communicator: the policy, the watchdog, the
        replica-local group, the engine, the ledger, the recruiter. ``mates``: this
        replica's ranks on MPI, ranked by shard (a replacement splits them from its spawn:
        it has no world yet); a replacement also passes the survivors' heartbeat directory."""
        assert self.comm is not None and self.layout is not None
        from mpi4py import MPI

        mates.Set_errhandler(MPI.ERRORS_RETURN)
        self.mates = mates
        c, host = self.config, self.host
        # A replacement's policy is replaced by the donor's state before its first step.
        self.policy = make_policy(c.policy, self.layout.replicas, c.grad_accum, T=c.target_replicas, min_replicas=c.min_replicas)
        if self.hang_timeout_s:
            self.watchdog = HangWatchdog(
                self.comm.rank, self.hang_timeout_s, stuck_timeout=self.stuck_timeout_s, directory=heartbeats
            ).start()
        backend = "nccl" if host.device_type() == "cuda" else "gloo"
        host.init_replica_group(self.comm, c.shards, c.timeout_s, backend, gather=mates.allgather)
        host.on_ranks()
        self.probes = host.make_probes(self.comm.rank, self.watchdog)
        # The engine divides by B x the data-parallel ranks (each sums its slice's gradient); TP ranks of
        # one data-parallel index compute the same samples and are not counted again.
        self.engine = engine = StepEngine(
            self.comm, self.policy, shards=c.data_parallel, hooks=host.hooks, probes=self.probes, on_repair=self.on_repair,
            overlap=c.overlap,
        )
        self.replica_group = new_replica_group(
            self.comm, engine.run_collective, refuse=lambda: lockstep_refusal(engine.state, host.evaluating()),
            probes=self.probes, step=host.step,
        )
        if c.ledger_path is not None:
            self.ledger = LeaderLedger(c.ledger_path, guard=lambda: self.comm.check_fences("step ledger"))  # type: ignore[union-attr]
        # Only the newest world of the newest launch writes the ledger and the checkpoints.
        guarded = [Path(c.ledger_path).parent] if c.ledger_path is not None else []
        if c.checkpoint.dir is not None:
            guarded.append(Path(c.checkpoint.dir))
        self.comm.guard_writes(guarded)
        if c.rejoin.enabled or c.salvaging:
            self.recruiter = self._make_recruiter()
            if self.joining is None and c.rejoin.enabled:
                # Standbys start now, while this job still sets up, not after its first loss; the
                # first step waits for them, every rank in a barrier that leaves the cores to them.
                self.recruiter.tend(training=False)
                if c.rejoin.standbys and c.rejoin.standbys_wait_s:
                    self.recruiter.await_warm(c.rejoin.standbys_wait_s)
                    # A rank lost while the others wait here is repaired like one lost in a step.
                    engine.run_collective(self.comm.barrier)

    def _make_recruiter(self) -> Recruiter:
        assert self.comm is not None and self.layout is not None
        c, layout = self.config, self.layout

        def context() -> dict[str, Any]:
            return {
                "world_size": layout.world_size, "timeout_s": c.rejoin.timeout_s,
                "heartbeats": str(self.watchdog.dir) if self.watchdog is not None else None,
                "logger_versions": self.host.logger_versions(),
                "environ": job_environ(),
            }

        rejoin = c.rejoin
        return Recruiter(
            self.comm, hosts=rejoin.hosts, attempts=rejoin.attempts, backoff_s=rejoin.backoff_s,
            timeout_s=rejoin.timeout_s, context=context, standbys=rejoin.standbys, shards=c.shards,
            fault_point=self._recruiter_fault_point, spawn=rejoin.enabled,
        )

    def _recruiter_fault_point(self, phase: str, attempt: int) -> None:
        if self.probes is not None:
            self.probes.fault_point(phase, step=attempt)

    def on_repair(self, res: RepairResult) -> None:
        """A repair moved leadership, perhaps to this rank: the host's gates follow; a re-join attempt is dropped."""
        self.host.on_membership()
        if self.recruiter is not None:
            self.recruiter.note_loss()
            if self.recruiter.attempt is not None:
                self.recruiter.drop(f"the survivors' world was repaired (lost replica(s) {list(res.lost_replicas)})",
                                    notify=False, repaired=True)
        if self.comm is not None and self.global_rank == 0:
            print(
                f"[lightning-recover] world epoch {self.comm.world_epoch}: lost replica(s) {list(res.lost_replicas)}; "
                f"alive {list(self.comm.alive_replicas)}; repaired in {res.seconds:.3f} s ({res.rounds} round(s)); "
                "the step goes on in place with the same batch",
                file=sys.stderr,
                flush=True,
            )

    # ------------------------------------------------------------------ resume
    def state_dict(self, *, step: int, planner: dict[str, Any]) -> dict[str, Any]:
        """The protocol's state at ``step`` (``planner``: the sample order's), as checkpoints and donors carry it."""
        assert self.policy is not None and self.comm is not None
        return {
            "B": self.policy.B, "grad_accum": self.policy.G_init, "target_replicas": self.policy.T, "shards": self.config.shards,
            "seed": self.config.seed, "policy_name": self.config.policy, "policy": self.policy.state_dict(),
            "planner": planner, "step": step,
            "replicas": list(self.comm.alive_replicas), "world_epoch": self.comm.world_epoch,
            "rng": {"torch": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take B, G_init, T and the sample order from a checkpoint; fit the policy to today's replicas.

        Raises ``ConfigurationError`` when the configured policy cannot keep the checkpoint's B."""
        assert self.layout is not None and self.engine is not None
        self.resumed = state
        self.config = dataclasses.replace(
            self.config, seed=int(state["seed"]), grad_accum=int(state["grad_accum"]), target_replicas=int(state["target_replicas"])
        )
        c, W = self.config, self.layout.replicas
        assert c.target_replicas is not None
        if c.policy == "static":
            # Fewer replicas than T: the missing ones count as lost, B stays T * G_init.
            self.policy = make_policy("static", max(W, c.target_replicas), c.grad_accum, T=c.target_replicas, min_replicas=c.min_replicas)
        else:
            self.policy = make_policy(c.policy, W, c.grad_accum, min_replicas=c.min_replicas)
        if self.policy.B != int(state["B"]):
            raise ConfigurationError(f"cannot keep B={state['B']} with policy {c.policy!r} on {W} replicas")
        self.engine.policy = self.policy
        if self.ledger is not None:
            self.ledger.resumed = True

    def take_over(self, state: dict[str, Any]) -> None:
        """A replacement takes the donor's protocol state: policy, sample order, fault count, RNG."""
        assert self.policy is not None and self.engine is not None
        self.policy.load_state_dict(state["policy"])
        self.engine.faults_seen = int(state.get("faults_seen", 0))
        self.resumed = state  # the data planner loads the sample order from it
        torch.set_rng_state(state["rng"]["torch"])

    # ------------------------------------------------------------------ close
    def orphaned(self) -> None:
        """Salvage: this rank left the world as an orphan (:mod:`lightning_recover.membership.orphan`). What
        watched or served its old membership stops; MPI, the lobby and the process stay for its seat."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.recruiter is not None:
            self.recruiter.close()
        if dist.is_initialized():
            dist.destroy_process_group()  # the seated script's strategy makes its own

    def close(self) -> None:
        """The survivors' last agreement (repairing a death after the last commit), then the watchdog stops."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.comm is not None and self.engine is not None and self.probes is not None:
            with self.probes.waiting():
                if not self.comm.agree(True):
                    # A replica died after the last commit (e.g. the leader before writing its
                    # ledger line): repair, and let a new leader record what is missing.
                    self.engine.repaired(self.comm.repair())
                    if self.ledger is not None:
                        self.ledger.backfill(is_leader=self.global_rank == 0)
                    self.comm.agree(True)
        if self.watchdog is not None:
            self.watchdog.stop()

    def shutdown(self, exit_code: int | None = None) -> None:
        """End the job: :meth:`close` unless it already ended, then leave (at once, with ``exit_code``)."""
        if self.comm is None or not lifecycle.job_ended(self.comm):
            self.close()
        if self.comm is not None:
            lifecycle.end_job(self.comm, exit_code)
