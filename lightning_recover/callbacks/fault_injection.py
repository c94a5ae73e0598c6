"""Fault injection for tests and chaos runs: kill, stop or wedge this very process at a chosen point.

Schedule entries are ``{step, rank, phase, kind}`` with optional ``microbatch`` and
``bucket``. ``rank`` is an ORIGINAL world rank; ``step`` the optimizer step (0-based).
``phase`` is one of forward | backward | reduce | optimizer | checkpoint | validation |
test | predict | the re-join and collective phases below; ``checkpoint`` fires while the leader replica writes the checkpoint of
global step ``step``, after this rank's shard file is written and before anything is
renamed into place; validation / test / predict fire before this rank's ``microbatch``-th
batch (0-based) of an evaluation loop run at global step ``step`` (never in the sanity check).
The hot re-join phases count ``step`` as the re-join attempt (1-based) instead:
``join_startup`` fires in a replacement before it says it is ready, ``join_ready`` right
after (before it waits for the survivors' decision), ``join_transfer`` in
the donor before it sends the live state and in a replacement before it receives it, and
``joined`` in a replacement at the start of its first step, and ``join_accept`` in a
survivor just before the survivors accept a seated standby (the attempt's merge; a death
here leaves the standby connecting to an accept that never completes). ``collective`` and
``collective_done`` fire in this rank's ``microbatch``-th call (0-based, counted within
step ``step``) over ``strategy.replica_group`` (:mod:`lightning_recover.comm.process_group`):
before its MPI calls (its peers are left waiting inside the collective), and after they
returned, before the survivors agree on the result (its peers may have completed it).
``first_broadcast`` (``step`` 0) fires in the strategy's setup just before the first broadcast
of the initial weights from replica 0 (its peers are left waiting inside it): a start-up fault.
``kind`` is kill (SIGKILL), hang (SIGSTOP: no thread of the process runs), stuck (the
main thread spins forever while the process stays alive, like a rank wedged in compute) or
term (SIGTERM, as mpiexec aborting a job or a scheduler draining a node sends it: the
strategy lets it end the rank at once, as killed by the signal, see
:func:`lightning_recover.runtime.lifecycle.die_on_sigterm`). ``microbatch``
pins forward/backward to the k-th microbatch (0-based) this replica computes in that
step; ``bucket`` pins reduce to that bucket index (default 0). ``kind: corrupt`` is silent
data corruption instead: the process lives on, and one bit (bit 20 of the first element:
a small change, as an SDC usually is) of this rank's ``target`` flips -- ``params`` (the
first parameter's local shard), ``grads`` (its gradient) or ``optimizer`` (its first
optimizer state tensor, e.g. Adam's ``exp_avg``); e.g. ``{step: 3, rank: 2, phase:
optimizer, kind: corrupt, target: params}`` corrupts rank 2 just before step 3's update.
The strategy calls
:meth:`FaultInjection.at` at each point; an entry fires once.

Host-level faults (a rank cannot do them to its own host; a harness outside the job does)
    ``kind`` ``host_ranks_kill`` (every rank of this rank's host SIGKILLed, Open MPI's
    daemon there lives on), ``host_kill`` (the whole host lost: ranks and daemon),
    ``host_freeze`` (every process of the host SIGSTOPped), ``host_partition`` (the host's
    link down for good) and ``host_flap`` (the link down for ``seconds``, default
    :data:`FLAP_DEFAULT_S`, then up again). ``rank`` names the rank whose arrival at the
    point triggers the fault *and* the host it hits (the host that rank runs on). At a re-join
    phase that is the replacement's host (a spare host, by the placement rule of
    :mod:`lightning_recover.membership.placement`), or the donor's for ``join_transfer``.
    Contract with the harness (:class:`benchmarks.rigs.host_faults.HostFaultHarness`
    on fake hosts, or any other that speaks it):

    1. The harness sets :data:`ENV_HOST_FAULTS` to a directory every rank can write and
       watches it.
    2. At the point, the rank writes ``request.R.STEP.PHASE.json`` there (atomically: a
       rename), holding ``kind``, ``rank``, ``step``, ``phase``, ``host`` (its hostname),
       ``pid`` and ``seconds``, then waits, without calling MPI, for ``done.R.STEP.PHASE``.
    3. The harness applies the fault to that host, then writes the ``done`` file. A rank
       that was killed or frozen never sees it; a partitioned or flapping host's rank sees
       it and goes on into the cut, so the fault lands exactly at the chosen point.
    4. No ``done`` within :data:`HOST_FAULT_ACK_S` seconds, or no :data:`ENV_HOST_FAULTS`
       at all, is an error naming the variable: the schedule asked for a fault nobody applies.

    The wait is short (the harness polls every 50 ms), far below Open MPI's heartbeat
    timeout, so the waiting rank itself is never taken for dead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

PHASES = (
    "forward", "backward", "reduce", "optimizer", "checkpoint", "validation", "test", "predict",
    "join_startup", "join_ready", "join_transfer", "joined", "join_accept", "collective", "collective_done",
    "first_broadcast",
)
EVALUATION_PHASES = ("validation", "test", "predict")
COLLECTIVE_PHASES = ("collective", "collective_done")
#: Host-level kinds: applied by a harness outside the job (module docstring).
HOST_KINDS = ("host_ranks_kill", "host_kill", "host_freeze", "host_partition", "host_flap")
KINDS = ("kill", "hang", "stuck", "term", "corrupt", *HOST_KINDS)
#: The directory a host-fault harness watches for requests (module docstring).
ENV_HOST_FAULTS = "LIGHTNING_RECOVER_HOST_FAULTS"
#: How long a rank waits for the harness to confirm a host fault it asked for.
HOST_FAULT_ACK_S = 30.0
#: How long a ``host_flap`` keeps the link down unless its entry says ``seconds``.
FLAP_DEFAULT_S = 3.0
#: What ``kind: corrupt`` flips a bit of.
TARGETS = ("params", "grads", "optimizer")
_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "term": signal.SIGTERM}


@dataclass(frozen=True)
class FaultSpec:
    step: int
    rank: int
    phase: str
    kind: str = "kill"
    microbatch: int | None = None
    bucket: int | None = None
    target: str | None = None
    #: ``host_flap`` only: how long the link stays down.
    seconds: float | None = None

    @classmethod
    def parse(cls, entry: Mapping[str, Any] | FaultSpec, index: int = 0) -> FaultSpec:
        if isinstance(entry, FaultSpec):
            return entry
        if not isinstance(entry, Mapping):
            raise ValueError(f"fault.schedule[{index}] must be a mapping like {{step: 3, rank: 2, phase: backward, kind: kill}}, got {entry!r}")
        unknown = set(entry) - {"step", "rank", "phase", "kind", "microbatch", "bucket", "target", "seconds"}
        if unknown:
            raise ValueError(
                f"fault.schedule[{index}] has unknown keys {sorted(unknown)}; "
                "allowed: step, rank, phase, kind, microbatch, bucket, target, seconds"
            )
        for key in ("step", "rank", "phase"):
            if key not in entry:
                raise ValueError(f"fault.schedule[{index}] is missing '{key}': {dict(entry)!r}")
        phase, kind = str(entry["phase"]), str(entry.get("kind", "kill"))
        if phase not in PHASES:
            raise ValueError(f"fault.schedule[{index}].phase={phase!r} is not one of {PHASES}")
        if kind not in KINDS:
            raise ValueError(f"fault.schedule[{index}].kind={kind!r} is not one of {KINDS}")
        if kind == "stuck" and phase == "checkpoint":
            raise ValueError(
                f"fault.schedule[{index}]: kind=stuck at phase=checkpoint would spin forever unseen (checkpoint writes "
                "never count as stuck); use kind=hang or kill there"
            )
        target = entry.get("target")
        if kind == "corrupt":
            target = "params" if target is None else str(target)
            if target not in TARGETS:
                raise ValueError(f"fault.schedule[{index}].target={target!r} is not one of {TARGETS}")
        elif target is not None:
            raise ValueError(f"fault.schedule[{index}].target={target!r} applies only to kind=corrupt (this entry is kind={kind})")
        seconds = entry.get("seconds")
        if kind == "host_flap":
            seconds = FLAP_DEFAULT_S if seconds is None else seconds
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 600:
                raise ValueError(f"fault.schedule[{index}].seconds={seconds!r} must be a number of seconds in (0, 600) (how long the link stays down)")
            seconds = float(seconds)
        elif seconds is not None:
            raise ValueError(f"fault.schedule[{index}].seconds={seconds!r} applies only to kind=host_flap (this entry is kind={kind})")
        ints = {}
        for key in ("step", "rank", "microbatch", "bucket"):
            v = entry.get(key)
            if v is None:
                ints[key] = None
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"fault.schedule[{index}].{key}={v!r} must be a non-negative integer")
            ints[key] = v
        return cls(ints["step"], ints["rank"], phase, kind, ints["microbatch"], ints["bucket"], target, seconds)  # type: ignore[arg-type]


class FaultInjection(Callback):
    """Fires the scheduled faults of this rank; see the module docstring."""

    def __init__(self, schedule: Iterable[Mapping[str, Any] | FaultSpec] = ()) -> None:
        self.schedule = [FaultSpec.parse(e, i) for i, e in enumerate(schedule)]
        self._fired: set[int] = set()
        self._trainer: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer  # kind=corrupt reaches the model and the optimizer through it

    def at(self, phase: str, *, step: int, rank: int, microbatch: int | None = None, bucket: int | None = None) -> None:
        for i, spec in enumerate(self.schedule):
            if i in self._fired or spec.rank != rank or spec.step != step or spec.phase != phase:
                continue
            if phase in ("forward", "backward", *EVALUATION_PHASES, *COLLECTIVE_PHASES) and (spec.microbatch or 0) != (microbatch or 0):
                continue
            if phase == "reduce" and (spec.bucket or 0) != (bucket or 0):
                continue
            self._fired.add(i)
            print(
                f"[lightning-recover] fault injection: {spec.kind} rank {rank} at step {step} {phase}"
                + (f" microbatch {microbatch}" if microbatch is not None else "")
                + (f" bucket {bucket}" if bucket is not None else ""),
                file=sys.stderr,
                flush=True,
            )
            if spec.kind == "corrupt":
                self._corrupt(spec.target or "params")
                continue
            if spec.kind in HOST_KINDS:
                request_host_fault(spec, rank)
                continue
            if spec.kind == "stuck":
                _spin_forever()
            os.kill(os.getpid(), _SIGNALS[spec.kind])

    def _corrupt(self, target: str) -> None:
        """Flip one bit of this rank's ``target`` in place (see the module docstring)."""
        strategy = self._trainer.strategy
        p = next(q for q in strategy.model.parameters() if q.requires_grad)
        if target == "params":
            t = p.data
        elif target == "grads":
            if p.grad is None:
                raise RuntimeError("kind=corrupt target=grads fired where the parameter has no gradient; use phase=optimizer")
            t = p.grad
        else:
            opt = getattr(strategy.optimizers[0], "_optimizer", strategy.optimizers[0])  # the torch optimizer inside
            state = [v for _, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor) and v.numel() > 1]
            if not state:
                raise RuntimeError("kind=corrupt target=optimizer fired before the optimizer has state; use a later step")
            t = state[0]
        local = t.to_local() if hasattr(t, "to_local") else t
        words = local.view(-1).view(torch.int32) if local.element_size() == 4 else local.view(-1).view(torch.int16)
        words[0] ^= 1 << (20 if local.element_size() == 4 else 10)


def host_fault_name(rank: int, step: int, phase: str) -> str:
    """The ``R.STEP.PHASE`` part of a host fault's request and done file names."""
    return f"{rank}.{step}.{phase}"


def request_host_fault(spec: FaultSpec, rank: int) -> None:
    """Ask the harness named by :data:`ENV_HOST_FAULTS` to apply ``spec`` to this rank's host, and
    wait until it says it did (module docstring). Returns only for faults the rank outlives."""
    where = os.environ.get(ENV_HOST_FAULTS)
    if not where:
        raise RuntimeError(
            f"fault kind={spec.kind} (rank {rank}, step {spec.step}, {spec.phase}) needs a harness outside the job to apply it: "
            f"set {ENV_HOST_FAULTS} to the directory the harness watches (benchmarks/chaos.py --hosts N does), "
            "or use a rank-level kind (kill, hang, stuck)"
        )
    name = host_fault_name(rank, spec.step, spec.phase)
    request = {"kind": spec.kind, "rank": rank, "step": spec.step, "phase": spec.phase, "host": socket.gethostname(),
               "pid": os.getpid(), "seconds": spec.seconds}
    tmp = os.path.join(where, f".request.{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(request, f)
    os.replace(tmp, os.path.join(where, f"request.{name}.json"))  # the harness never reads a half-written request
    done = os.path.join(where, f"done.{name}")
    deadline = time.monotonic() + HOST_FAULT_ACK_S
    while not os.path.exists(done):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"fault kind={spec.kind} (rank {rank}, step {spec.step}, {spec.phase}): no harness confirmed it within "
                f"{HOST_FAULT_ACK_S:g} s ({done} never appeared); is a harness watching {ENV_HOST_FAULTS}={where}?"
            )
        time.sleep(0.01)


def _spin_forever() -> None:
    # Busy, like a wedged kernel loop; the interpreter still lets other threads (the
    # watchdog's heartbeat) run, so only the progress rule can tell this rank is stuck.
    x = 0
    while True:
        for _ in range(100_000):
            x += 1
        time.sleep(0)
