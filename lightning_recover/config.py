"""The settings of the recovery protocol, validated in one place.

The strategy and the Hydra example take their knobs as one frozen :class:`RecoverConfig`:
the layout (``shards``), the constant batch (``target_replicas`` T and ``grad_accum``
G_init, B = T * G_init), the workload ``policy`` and its stop rule (``min_replicas``), the
reduction's ``bucket_mb``, the step ledger, the seed of the sample order, the replica-local
group's timeout, the watchdog's hang and stuck timeouts, and three sections: the fallback
checkpoints (:class:`CheckpointConfig`, ``recover.checkpoint``), the silent-data-corruption
checks (:class:`SDCConfig`, ``recover.sdc``) and hot re-join (:class:`RejoinConfig`,
``recover.rejoin``).

Every section also has a *short form*, flat keywords such as ``checkpoint_dir=...`` or
``rejoin_standbys=2`` (:data:`SHORT_FORMS`), which the strategy's keywords
(:meth:`RecoverConfig.build`, ``from_arguments``) put into their section. Re-join's short
form, its settings' spelling before they became a section, is also read from mappings
(``from_mapping``, :func:`fold_short_forms`: YAML or dicts written with the flat keys build
the same config), and ``rejoin=True`` / ``rejoin=False`` means ``RejoinConfig(enabled=...)``
everywhere, the dataclass included. :class:`RecoverSettings` types every keyword
ReCoVerHSDPStrategy takes, so an IDE or a type checker flags a misspelt one as the run-time
check does.

A bad value is refused when the object is built, with a :class:`ConfigurationError` whose one
line names the value as the Hydra example spells it (``recover.<field>=<value>``) and the
fix. What needs the job's size (shards divides the world, T and min_replicas fit in the
replicas) is checked by :meth:`RecoverConfig.check_world` once the world size is known.
Checks that touch the file system (a writable ledger, a writable checkpoint directory)
belong to the caller.

Pure Python on purpose (no torch, MPI, Lightning or OmegaConf): a launcher or a Hydra script
can validate its settings in milliseconds, before any rank imports the heavy layers. The
dataclasses double as the OmegaConf structured schema of ``examples/pretrain.py``'s
``recover`` group, so their annotations stay within what OmegaConf understands.
"""

from __future__ import annotations

import difflib
import math
import operator
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from lightning_recover.errors import RecoverError

# typing's own Unpack from 3.11 keeps this module free of third-party imports there; type checkers
# read the version check, and typing_extensions (a dependency of torch) serves 3.10.
if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - the venv runs 3.11
    from typing_extensions import Unpack

__all__ = [
    "DATA_PLANES",
    "DEFAULT_BUCKET_MB",
    "POLICY_NAMES",
    "CheckpointConfig",
    "ConfigurationError",
    "RecoverConfig",
    "RecoverSettings",
    "RejoinConfig",
    "SDCConfig",
    "SHORT_FORMS",
    "fold_short_forms",
]

# Workload policies by config name (built by lightning_recover.workload.factory.make_policy).
POLICY_NAMES: tuple[str, ...] = ("static", "adaptive")
# Transports of the cross-replica gradient buckets (lightning_recover.comm.data_plane); the first is the default.
DATA_PLANES: tuple[str, ...] = ("mpi", "gloo", "nccl")
# Transports of FSDP2's collectives inside a replica (lightning_recover.comm.replica_plane).
REPLICA_PLANES: tuple[str, ...] = ("auto", "mpi", "torch")
# Gradient bucket of the cross-replica reduction, MiB (4 MiB = communicator.DEFAULT_BUCKET_BYTES).
DEFAULT_BUCKET_MB = 4.0


class ConfigurationError(RecoverError, ValueError):
    """A setting the job cannot run with; the one-line message names the value and the fix.

    A ValueError, so callers that caught the older per-module errors keep working.
    """


# ---------------------------------------------------------------------- field checks
def _refuse(key: str, value: Any, requirement: str, fix: str) -> ConfigurationError:
    """``<key> must be <requirement>, got <value> (recover.<key>=<value>); <fix>``.

    The bare name reads right for Python callers of the strategy, the ``recover.`` form for
    users of the Hydra example; both appear so each finds the value they set.
    """
    return ConfigurationError(f"{key} must be {requirement}, got {value!r} (recover.{key}={value!r}); {fix}")


def _integer(key: str, value: Any, minimum: int, fix: str, requirement: str | None = None) -> int:
    """``value`` as an int >= minimum; bools and floats are refused (numpy ints accepted)."""
    if isinstance(value, bool):
        raise _refuse(key, value, "an integer", fix)
    try:
        as_int = operator.index(value)
    except TypeError:
        raise _refuse(key, value, "an integer", fix) from None
    if as_int < minimum:
        raise _refuse(key, value, requirement or f">= {minimum}", fix)
    return as_int


def _number(key: str, value: Any, fix: str, *, positive: bool, finite: bool, requirement: str) -> float:
    """``value`` as a float: > 0 when ``positive`` else >= 0; NaN always refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(key, value, requirement, fix)
    as_float = float(value)
    ok = as_float > 0 if positive else as_float >= 0  # NaN fails both comparisons
    if not ok or (finite and math.isinf(as_float)):
        raise _refuse(key, value, requirement, fix)
    return as_float


def _path(key: str, value: Any, fix: str) -> str | None:
    """None, or a non-empty path (str or os.PathLike) as a str."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise _refuse(key, value, "a path or null", fix)
    text = os.fspath(value)
    if not isinstance(text, str) or not text:
        raise _refuse(key, value, "a non-empty path or null", fix)
    return text


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _check_keys(where: str, settings: Mapping[Any, Any], known: list[str]) -> None:
    unknown = sorted(str(k) for k in settings if k not in known)
    if unknown:
        near = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]}? " if near else ""
        raise ConfigurationError(
            f"{where}.{unknown[0]} is not a {where} setting; {hint}remove it or use one of: {', '.join(known)}"
        )


def _refuse_unknown_keywords(cls: type, kwargs: Mapping[str, Any], where: str) -> None:
    """A dataclass's ``__init__`` would refuse an unknown keyword with a bare TypeError
    ("unexpected keyword argument"), e.g. when Hydra's ``instantiate`` builds the class from YAML."""
    _check_keys(where, kwargs, _names(cls))


def _set(obj: object, name: str, value: Any) -> None:
    # The dataclasses are frozen; __post_init__ stores normalised values (e.g. Path -> str) this way.
    object.__setattr__(obj, name, value)


# ---------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class CheckpointConfig:
    """Fallback checkpoints written by the leader replica (``recover.checkpoint``).

    Attributes:
        dir: where checkpoints are written and where ``ckpt_path=last`` looks; None: nowhere.
            A directory with ``every_n_steps=0`` writes nothing but still names where to
            resume from. ``os.PathLike`` is accepted and stored as ``str``.
        every_n_steps: checkpoint period in committed steps; 0 = no checkpoints.
        async_save: write every checkpoint (also a user's ModelCheckpoint's) in the
            background: a save holds the step loop only while the shards are copied into
            CPU memory (one more copy of the replica-local model and optimizer state per
            rank while the write runs). False: the step loop waits for storage.
        consolidate: make each checkpoint file a full Lightning checkpoint
            (``Model.load_from_checkpoint(path)`` in a plain Python session). Costs one full
            copy of the model's state in CPU memory on the leader's shard 0 while it is
            written, in the background. False: the file holds everything but the weights,
            which only the DCP directory next to it holds (resume still works).
    """

    dir: str | None = None
    every_n_steps: int = 0
    async_save: bool = True
    consolidate: bool = True

    def __new__(cls, *args: Any, **kwargs: Any) -> CheckpointConfig:
        # Before the dataclass's __init__, whose refusal of an unknown keyword is a bare TypeError.
        _refuse_unknown_keywords(cls, kwargs, "recover.checkpoint")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _set(self, "dir", _path("checkpoint.dir", self.dir, "set recover.checkpoint.dir to a directory, or null for none"))
        every = _integer(
            "checkpoint.every_n_steps",
            self.every_n_steps,
            0,
            "set recover.checkpoint.every_n_steps to a step period, or 0 for no checkpoints",
        )
        _set(self, "every_n_steps", every)
        for key in ("async_save", "consolidate"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise _refuse(f"checkpoint.{key}", value, "true or false", f"set recover.checkpoint.{key} to true or false")
        if every > 0 and self.dir is None:
            raise ConfigurationError(
                f"recover.checkpoint.every_n_steps={every} > 0 needs recover.checkpoint.dir; "
                "set recover.checkpoint.dir to a directory (or recover.checkpoint.every_n_steps=0 for no checkpoints)"
            )

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are written at all."""
        return self.every_n_steps > 0


# ---------------------------------------------------------------------- silent data corruption
#: What happens to a replica whose fingerprint is the odd one out (recover.sdc.action).
SDC_ACTIONS: tuple[str, ...] = ("repair", "evict")


@dataclass(frozen=True)
class SDCConfig:
    """Silent-data-corruption checks (``recover.sdc``; :mod:`lightning_recover.callbacks.corruption_check`).

    Attributes:
        every_n_steps: compare the replicas' parameter and optimizer-state fingerprints
            after every N-th committed step (and, in that step, a spare's gradients with those
            of the contributor it shadows); 0 = off. The default, 20, keeps the step-time
            overhead under 1% (``benchmarks/sdc_overhead.py``).
        action: "repair" (the corrupted replica receives the state from a healthy one and
            goes on) or "evict" (it leaves, and the job recovers as from any failure).
    """

    every_n_steps: int = 20
    action: str = "repair"

    def __new__(cls, *args: Any, **kwargs: Any) -> SDCConfig:
        # Before the dataclass's __init__, whose refusal of an unknown keyword is a bare TypeError.
        _refuse_unknown_keywords(cls, kwargs, "recover.sdc")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _set(self, "every_n_steps", _integer(
            "sdc.every_n_steps", self.every_n_steps, 0, "set recover.sdc.every_n_steps to a step period, or 0 for no checks"
        ))
        if not isinstance(self.action, str) or self.action not in SDC_ACTIONS:
            raise _refuse("sdc.action", self.action, " or ".join(repr(a) for a in SDC_ACTIONS), "set recover.sdc.action=repair or recover.sdc.action=evict")

    @property
    def enabled(self) -> bool:
        return self.every_n_steps > 0


# ---------------------------------------------------------------------- hot re-join
@dataclass(frozen=True)
class RejoinConfig:
    """Hot re-join (``recover.rejoin``; :mod:`lightning_recover.membership.recruiter`).

    After losing replicas the job spawns replacements (the same interpreter and argv) up to
    the replica count it started with; they receive the live state and take work back.
    ``RecoverConfig(rejoin=True)`` is short for ``RejoinConfig(enabled=True)``, and the flat
    keys ``rejoin_hosts``, ``rejoin_standbys``, ... of the strategy and of a mapping are short
    for this section's ``hosts``, ``standbys``, ... (:func:`fold_short_forms`).

    Attributes:
        enabled: spawn replacements for lost replicas. Off by default.
        hosts: comma-separated hosts the replacements are placed on (Open MPI's ``host``
            spawn key, ``host:slots`` allowed); None = the placement rule of
            :mod:`lightning_recover.membership.placement` (the launcher's spare hosts, then
            its hosts with free slots, else the launch's hosts oversubscribed).
        attempts: spawn attempts per lost replica before the job carries on without.
        backoff_s: wait after a failed attempt before the next (doubling each time).
        timeout_s: a replacement not ready to join this long after its spawn was started is
            given up (it exits by itself; the attempt counts as failed).
        standbys: warm standbys the leader keeps (with ``enabled``): replica-sized groups of
            processes spawned ahead of any loss, which imported torch and Lightning and sleep
            until a replica is lost; one then runs the script as the lost replica's ranks at
            once. Each costs a process per shard (its memory, no core while it waits) for the
            whole run. 0 = replacements are spawned cold after a loss.
        standbys_wait_s: with ``standbys``, the first step waits until the standbys are warm,
            at most this long, so a loss in the first steps already finds one ready (a standby
            that dies or fails to spawn ends the wait for it). 0 = the first step starts at
            once and the standbys warm up beside the training.
    """

    enabled: bool = False
    hosts: str | None = None
    attempts: int = 3
    backoff_s: float = 5.0
    timeout_s: float = 120.0
    standbys: int = 0
    standbys_wait_s: float = 60.0

    def __new__(cls, *args: Any, **kwargs: Any) -> RejoinConfig:
        # Before the dataclass's __init__, whose refusal of an unknown keyword is a bare TypeError.
        _refuse_unknown_keywords(cls, kwargs, "recover.rejoin")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise _refuse("rejoin.enabled", self.enabled, "true or false",
                          "set recover.rejoin.enabled=true to spawn replacements, false not to")
        if self.hosts is not None and (not isinstance(self.hosts, str) or not self.hosts.strip()):
            raise _refuse("rejoin.hosts", self.hosts, "a comma-separated host list",
                          "e.g. recover.rejoin.hosts=node7,node8 (null: the launch's hosts)")
        _set(self, "attempts", _integer("rejoin.attempts", self.attempts, 1, "set recover.rejoin.attempts to a positive integer"))
        _set(self, "standbys", _integer("rejoin.standbys", self.standbys, 0,
                                        "set recover.rejoin.standbys to the warm standbys to keep (0 = none)"))
        for key, positive, fix in (
            ("backoff_s", False, "set recover.rejoin.backoff_s to the seconds between spawn attempts"),
            ("timeout_s", True, "set recover.rejoin.timeout_s to the seconds a replacement may take to start"),
            ("standbys_wait_s", False, "set recover.rejoin.standbys_wait_s to the seconds the first step may wait for "
                                       "the standbys to be warm (0 = not at all)"),
        ):
            _set(self, key, _number(f"rejoin.{key}", getattr(self, key), fix, positive=positive, finite=True,
                                    requirement="a number of seconds"))


# ---------------------------------------------------------------------- the protocol's settings
@dataclass(frozen=True)
class RecoverConfig:
    """Settings of ReCoVerHSDPStrategy (the ``recover`` group of the Hydra example).

    Attributes:
        shards: ranks per replica (S); FSDP2 shards the model over them. The world size
            must be a multiple (:meth:`check_world`). 1 = plain replication.
        tensor_parallel: of the S ranks of a replica, how many hold tensor-parallel parts
            of one layer (TP); a divisor of ``shards``. The replica is then a 2-D mesh
            ``("data_parallel", "tensor_parallel")`` of ``shards // tensor_parallel`` x
            ``tensor_parallel`` ranks, as ``ModelParallelStrategy(data_parallel_size,
            tensor_parallel_size)`` builds it; the TP ranks of one data-parallel index see the
            same samples. 1 (default) = no tensor parallelism, a 1-D ``"data_parallel"`` mesh.
        grad_accum: G_init, microbatches per contributing replica per step.
        target_replicas: T, contributing replicas; None = all W replicas. The other W - T
            start as spares. B = T * G_init stays constant through failures. On a resume,
            T (with B and G_init) comes from the checkpoint; pass None then.
        policy: "static" (ReCoVer: constant B) or "adaptive" (the batch shrinks; the
            ablation, which has no spares, so T must be all replicas).
        min_replicas: stop with a clear error when fewer replicas are alive.
        bucket_mb: gradient bucket size (MiB) of the cross-replica reduction.
        data_plane: what carries those buckets (:mod:`lightning_recover.comm.data_plane`): "mpi"
            (ULFM MPI itself), "gloo" (a torch.distributed gloo group per world epoch; CPU)
            or "nccl" (an NCCL group per world epoch; CUDA only). ULFM MPI stays the
            control plane (failure detection, agreement, membership) in every case.
        replica_plane: what carries FSDP2's all-gathers and reduce-scatters *inside* a
            replica (:mod:`~.comm.replica_plane`): "mpi" (Open MPI's shared memory
            and network transports, CPU only), "torch" (torch's replica-local group: gloo
            on CPU, NCCL on CUDA) or "auto" (default: "mpi" on CPU with the MPI data
            plane, else "torch").
        ledger_path: JSON-lines step ledger written by the current leader; None = no
            ledger. ``os.PathLike`` is accepted and stored as ``str``.
        seed: seeds the sample order and the per-microbatch RNG.
        timeout_s: timeout of the replica-local process group (seconds); also how long the
            gloo/nccl data plane waits for a slow peer when no failure is seen.
        hang_timeout_s: a rank whose heartbeat stops this long is killed and its replica
            removed. None = the launcher's ``--hang-timeout`` (else 10 s); 0 = off.
        stuck_timeout_s: also kill a rank making no progress inside a step's compute for
            this long. None = the hang timeout; 0 = off. See :meth:`watchdog_timeouts`.
        checkpoint: the fallback checkpoints (:class:`CheckpointConfig`).
        sdc: the silent-data-corruption checks (:class:`SDCConfig`).
        rejoin: hot re-join (:class:`RejoinConfig`): after losing replicas the job spawns
            replacements up to the replica count it started with. ``True``/``False`` is short
            for ``RejoinConfig(enabled=...)``; a mapping is the section's settings.
        salvage: the live ranks of a replica that lost a rank wait as *orphans* instead of
            leaving; at a step boundary orphans whose shard indices complete one another are
            seated again as a whole replica (no process spawned; docs/salvage.md). Off by
            default (in progress: not yet proven by the chaos campaign).
        salvage_wait_s: how long an orphan waits for its seat before it leaves.
        overlap: start each step's cross-replica reduction during its last backward,
            bucket by bucket as backward produces the gradients (:mod:`~.recovery.overlap`);
            recovery rounds stay synchronous. False = reduce after the last backward.
        sync_every_microbatch: with shards > 1, reduce-scatter the gradients inside a
            replica after every microbatch. False (default) does it once per step, on the
            last planned microbatch, like stock HSDP with ``set_requires_gradient_sync``:
            G - 1 fewer in-replica collectives per step, but between microbatches every
            rank holds the *unsharded* gradient of the whole model (S times its gradient
            shard). Set True when that memory is not there.
    """

    shards: int = 1
    grad_accum: int = 1
    target_replicas: int | None = None
    policy: str = "static"
    min_replicas: int = 1
    bucket_mb: float = DEFAULT_BUCKET_MB
    data_plane: str = "mpi"
    replica_plane: str = "auto"
    ledger_path: str | None = None
    seed: int = 0
    timeout_s: float = 60.0
    hang_timeout_s: float | None = None
    stuck_timeout_s: float | None = None
    checkpoint: CheckpointConfig = CheckpointConfig()
    sdc: SDCConfig = SDCConfig()
    rejoin: RejoinConfig = RejoinConfig()
    salvage: bool = False
    salvage_wait_s: float = 300.0
    overlap: bool = True
    sync_every_microbatch: bool = False
    tensor_parallel: int = 1

    def __new__(cls, *args: Any, **kwargs: Any) -> RecoverConfig:
        # Before the dataclass's __init__, whose refusal of an unknown keyword is a bare TypeError.
        short = sorted(key for key in kwargs if key in SHORT_FORMS)
        if short:
            # The constructor keeps to the fields (what its dataclass signature, and so an IDE, shows);
            # the short forms belong to the builders. Say both spellings rather than "not a setting".
            group, name = short[0].split("_", 1)
            raise ConfigurationError(
                f"recover.{short[0]} is a short form that RecoverConfig(...) does not take; write "
                f"{group}={{{name!r}: ...}} (recover.{group}.{name}), or pass {short[0]}=... to "
                "RecoverConfig.build(...) or ReCoVerHSDPStrategy(...)"
            )
        _refuse_unknown_keywords(cls, kwargs, "recover")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # In this order: the first bad value is the one named.
        self._check_layout()
        self._check_policy_and_planes()
        self._check_files_and_timeouts()
        self._check_recovery()
        self._check_groups()

    def _check_layout(self) -> None:
        """shards, tensor_parallel, grad_accum, target_replicas."""
        shards_fix = "set recover.shards to the ranks per replica (a divisor of the world size)"
        _set(self, "shards", _integer("shards", self.shards, 1, shards_fix, requirement="a positive integer"))
        tp_fix = f"set recover.tensor_parallel to a divisor of recover.shards={self.shards} (1 = no tensor parallelism)"
        _set(self, "tensor_parallel", _integer("tensor_parallel", self.tensor_parallel, 1, tp_fix, requirement="a positive integer"))
        if self.shards % self.tensor_parallel:
            raise _refuse("tensor_parallel", self.tensor_parallel, f"a divisor of recover.shards={self.shards}", tp_fix)
        accum_fix = "set recover.grad_accum to a positive integer (microbatches per replica per step)"
        _set(self, "grad_accum", _integer("grad_accum", self.grad_accum, 1, accum_fix))
        if self.target_replicas is not None:
            target_fix = "set recover.target_replicas to 1..replicas, or null for all"
            _set(self, "target_replicas", _integer("target_replicas", self.target_replicas, 1, target_fix))

    def _check_policy_and_planes(self) -> None:
        """The policy, min_replicas, the bucket size, the data and replica planes."""
        if not isinstance(self.policy, str) or self.policy not in POLICY_NAMES:
            raise ConfigurationError(
                f"unknown policy {self.policy!r} (recover.policy={self.policy!r}); use "
                + " or ".join(f"recover.policy={p}" for p in POLICY_NAMES)
            )
        min_fix = "set recover.min_replicas to a positive integer"
        _set(self, "min_replicas", _integer("min_replicas", self.min_replicas, 1, min_fix))
        bucket_fix = "set recover.bucket_mb to the MiB per gradient bucket (e.g. 4)"
        _set(self, "bucket_mb", _number("bucket_mb", self.bucket_mb, bucket_fix, positive=True, finite=True, requirement="a positive number"))
        if not isinstance(self.data_plane, str) or self.data_plane not in DATA_PLANES:
            raise _refuse(
                "data_plane", self.data_plane, " or ".join(repr(p) for p in DATA_PLANES),
                "set recover.data_plane=mpi (the default), gloo (torch.distributed on CPU) or nccl (CUDA)",
            )
        if not isinstance(self.replica_plane, str) or self.replica_plane not in REPLICA_PLANES:
            raise _refuse(
                "replica_plane", self.replica_plane, " or ".join(repr(p) for p in REPLICA_PLANES),
                "set recover.replica_plane=auto (the default), mpi (CPU) or torch",
            )

    def _check_files_and_timeouts(self) -> None:
        """The ledger path, the seed and the timeouts."""
        ledger_fix = "set recover.ledger_path to a file path, or null for no ledger"
        _set(self, "ledger_path", _path("ledger_path", self.ledger_path, ledger_fix))
        _set(self, "seed", _integer("seed", self.seed, 0, "set the seed to a non-negative integer"))
        timeout_fix = "set recover.timeout_s to the seconds the replica-local process group waits"
        _set(self, "timeout_s", _number(
            "timeout_s", self.timeout_s, timeout_fix, positive=True, finite=True, requirement="a positive number of seconds"
        ))
        # inf is allowed for the watchdog timeouts: it never fires (like 0, which turns the rule off).
        seconds = ">= 0 seconds (0 = off)"
        if self.hang_timeout_s is not None:
            hang_fix = "set recover.hang_timeout_s to seconds, 0 to turn hang detection off, or null for the launcher's --hang-timeout"
            _set(self, "hang_timeout_s", _number(
                "hang_timeout_s", self.hang_timeout_s, hang_fix, positive=False, finite=False, requirement=seconds
            ))
        if self.stuck_timeout_s is not None:
            stuck_fix = "set recover.stuck_timeout_s to seconds, 0 to turn stuck detection off, or null for the hang timeout"
            _set(self, "stuck_timeout_s", _number(
                "stuck_timeout_s", self.stuck_timeout_s, stuck_fix, positive=False, finite=False, requirement=seconds
            ))

    def _check_recovery(self) -> None:
        """The switches and salvage (re-join is a section: :meth:`_check_groups`)."""
        for key, what in (("overlap", "overlap the reduction with backward"), ("sync_every_microbatch", "reduce-scatter after every microbatch"),
                          ("salvage", "keep a broken replica's live ranks as orphans")):
            if not isinstance(getattr(self, key), bool):
                raise _refuse(key, getattr(self, key), "true or false", f"set recover.{key}=true to {what}, false not to")
        salvage_fix = "set recover.salvage_wait_s to the seconds an orphan waits for its seat"
        _set(self, "salvage_wait_s", _number("salvage_wait_s", self.salvage_wait_s, salvage_fix, positive=True, finite=True,
                                             requirement="a number of seconds"))

    def _check_groups(self) -> None:
        """The sdc, checkpoint and rejoin sections (a mapping is the section's settings, ``rejoin=True`` its short form)."""
        # A mapping (a dict, or OmegaConf's DictConfig when Hydra's instantiate builds this class) is the group's settings.
        _set(self, "sdc", _group("sdc", self.sdc, SDCConfig))
        _set(self, "checkpoint", _group("checkpoint", self.checkpoint, CheckpointConfig))
        # rejoin=True/False predates the section: a bool is its switch, the rest at their defaults.
        rejoin = RejoinConfig(enabled=self.rejoin) if isinstance(self.rejoin, bool) else self.rejoin
        _set(self, "rejoin", _group("rejoin", rejoin, RejoinConfig))
        if not isinstance(self.sdc, SDCConfig):
            raise ConfigurationError(
                f"recover.sdc={self.sdc!r} is not an SDCConfig; pass SDCConfig(every_n_steps=..., action=...) "
                "or a mapping of those settings (recover.sdc.every_n_steps, recover.sdc.action)"
            )
        if not isinstance(self.checkpoint, CheckpointConfig):
            raise ConfigurationError(
                f"recover.checkpoint={self.checkpoint!r} is not a CheckpointConfig; pass CheckpointConfig(dir=..., every_n_steps=...) "
                "or a mapping of those settings (recover.checkpoint.dir, recover.checkpoint.every_n_steps)"
            )
        if not isinstance(self.rejoin, RejoinConfig):
            raise ConfigurationError(
                f"recover.rejoin={self.rejoin!r} is not a RejoinConfig; pass rejoin=True/False, RejoinConfig(enabled=..., "
                "standbys=...) or a mapping of those settings (recover.rejoin.enabled, recover.rejoin.standbys, ...)"
            )

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> RecoverConfig:
        """Build from plain data (YAML, JSON, an OmegaConf ``DictConfig`` or its resolved container).

        ``checkpoint``, ``sdc`` and ``rejoin`` may be mappings (or None for the defaults);
        ``rejoin`` may also be a bool, and the flat ``rejoin_*`` keys stand for the rejoin
        section's (:func:`fold_short_forms`), so a mapping written before the section existed,
        e.g. ``dataclasses.asdict`` of an older RecoverConfig, still builds. Unknown keys are
        refused by name, so a typo never silently falls back to a default.
        """
        if not isinstance(settings, Mapping):
            raise ConfigurationError(f"recover={settings!r} is not a mapping of settings; known: {', '.join(_names(cls))}")
        values = fold_short_forms(_plain("recover", settings, [*_names(cls), *_REJOIN_SHORT]))
        groups = {key: _group(key, values.pop(key, None), group)
                  for key, group in (("checkpoint", CheckpointConfig), ("sdc", SDCConfig), ("rejoin", RejoinConfig))}
        return cls(**values, **groups)

    @classmethod
    def from_arguments(cls, **settings: Unpack[RecoverSettings]) -> RecoverConfig:
        """Build from ReCoVerHSDPStrategy's keyword arguments (typed by :class:`RecoverSettings`).

        Every field is a keyword. The groups come either nested (``checkpoint={"dir": ...,
        "every_n_steps": ...}`` or a :class:`CheckpointConfig`, ``sdc={...}`` or an
        :class:`SDCConfig`, ``rejoin={...}`` or a :class:`RejoinConfig`: Hydra's
        ``instantiate`` of a YAML group) or flat, the short forms of :data:`SHORT_FORMS`
        (``checkpoint_dir``/``checkpoint_every_n_steps``/``checkpoint_async_save``/
        ``checkpoint_consolidate``, ``sdc_every_n_steps``/``sdc_action``, ``rejoin=True`` with
        ``rejoin_hosts``/``rejoin_standbys``/...), not both. Unlike the Hydra group, where a
        directory with period 0 only names where to resume from, a flat ``checkpoint_dir`` asks
        for checkpoints, so it needs a period >= 1. An unknown keyword is refused by name, with
        the nearest known one.
        """
        values = fold_short_forms(_plain("", settings, [*_names(cls), *SHORT_FORMS]))
        flat = {group: {name: values.pop(f"{group}_{name}") for name in names if f"{group}_{name}" in values} for group, names in _FLAT.items()}
        for group, given in flat.items():
            if given and values.get(group) is not None:
                keywords = ", ".join(f"{group}_{name}" for name in given)
                raise ConfigurationError(
                    f"both {group}=... and {keywords} set recover.{group}; pass the group once: either "
                    f"{group}={{{', '.join(f'{n!r}: ...' for n in given)}}} or the flat {group}_* keywords"
                )
        checkpoint = flat["checkpoint"]
        if "dir" in checkpoint and checkpoint["dir"] is not None:
            every = _integer(
                "checkpoint.every_n_steps", checkpoint.get("every_n_steps", 0), 0, "set recover.checkpoint.every_n_steps"
            )
            if every < 1:
                raise ConfigurationError(
                    f"checkpoint_every_n_steps must be >= 1 with a checkpoint_dir, got {every}; "
                    "set recover.checkpoint.every_n_steps"
                )
        for group, given in flat.items():
            if given:
                values[group] = given
        return cls(**values)

    @classmethod
    def build(cls, config: RecoverConfig | Mapping[str, Any] | None = None, **settings: Unpack[RecoverSettings]) -> RecoverConfig:
        """The settings ReCoVerHSDPStrategy was given: ``config`` (a RecoverConfig, or a mapping of its
        fields such as a dict or a DictConfig) or keyword settings (:meth:`from_arguments`), not both."""
        if config is None:
            return cls.from_arguments(**settings)
        if settings:
            raise ConfigurationError(
                f"pass either config=RecoverConfig(...) or keyword settings, not both (got config and {sorted(settings)})"
            )
        if isinstance(config, cls):
            return config
        if isinstance(config, Mapping):
            return cls.from_mapping(config)
        raise ConfigurationError(
            f"config={config!r} is not a RecoverConfig nor a mapping of its settings; pass config=RecoverConfig(...), "
            "a dict of its fields (config={'grad_accum': 2, ...}), or the fields as keywords"
        )

    # ------------------------------------------------------------------ the job's size
    @property
    def data_parallel(self) -> int:
        """The data-parallel ranks of one replica (``shards // tensor_parallel``): each sees its own slice of a microbatch."""
        return self.shards // self.tensor_parallel

    def replicas(self, world_size: int) -> int:
        """W: replicas in a world of ``world_size`` ranks (refused unless shards divides it)."""
        try:
            world = -1 if isinstance(world_size, bool) else operator.index(world_size)
        except TypeError:
            world = -1
        if world < 1:
            raise ConfigurationError(f"world size must be a positive integer, got {world_size!r}; launch at least one rank")
        if world % self.shards:
            raise ConfigurationError(
                f"recover.shards={self.shards} does not divide the world size {world}; launch a multiple of "
                f"{self.shards} ranks (lightning-recover launch -n ...) or set recover.shards to a divisor of {world}"
            )
        return world // self.shards

    def target(self, world_size: int) -> int:
        """T: contributing replicas (``target_replicas``, or all W)."""
        replicas = self.replicas(world_size)
        return replicas if self.target_replicas is None else self.target_replicas

    def microbatches_per_step(self, world_size: int) -> int:
        """B = T * G_init, the microbatches every committed step sums."""
        return self.target(world_size) * self.grad_accum

    def check_world(self, world_size: int) -> None:
        """Refuse settings that do not fit a job of ``world_size`` ranks (call once it is known)."""
        replicas = self.replicas(world_size)
        target = self.target_replicas
        if target is not None and target > replicas:
            raise ConfigurationError(
                f"recover.target_replicas={target} but the job has {replicas} replicas "
                f"({world_size} ranks / {self.shards} shards); set recover.target_replicas <= {replicas} "
                "(null = all) or launch more ranks"
            )
        if self.policy == "adaptive" and target is not None and target != replicas:
            raise ConfigurationError(
                f"recover.target_replicas={target} with recover.policy=adaptive: the adaptive policy has no spares; "
                "set recover.target_replicas=null"
            )
        if self.min_replicas > replicas:
            raise ConfigurationError(
                f"recover.min_replicas={self.min_replicas} but the job has {replicas} replicas "
                f"({world_size} ranks / {self.shards} shards); lower it or launch more ranks"
            )

    # ------------------------------------------------------------------ derived values
    @property
    def salvaging(self) -> bool:
        """Salvage is on and can act: a replica of one rank (``shards=1``) leaves no live mate to orphan, so such
        a job runs exactly as with salvage off (no recruiter, no lobby, nothing added to its steps)."""
        return self.salvage and self.shards > 1

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes; at least one float32 element."""
        return max(4, int(self.bucket_mb * 2**20))

    def watchdog_timeouts(self, launcher_hang_timeout: float | None) -> tuple[float | None, float | None]:
        """``(hang, stuck)`` seconds the watchdog uses; None = that rule is off.

        ``launcher_hang_timeout`` is what applies when ``hang_timeout_s`` is None (the
        launcher's ``--hang-timeout``, see ``watchdog.default_hang_timeout``). 0 turns a
        rule off; an unset ``stuck_timeout_s`` follows the hang timeout.
        """
        hang = launcher_hang_timeout if self.hang_timeout_s is None else self.hang_timeout_s
        hang = hang or None
        stuck = hang if self.stuck_timeout_s is None else (self.stuck_timeout_s or None)
        return hang, stuck


#: The flat keywords of the strategy for each settings group: ``checkpoint_dir`` is ``checkpoint.dir``.
_FLAT: dict[str, tuple[str, ...]] = {
    "checkpoint": ("dir", "every_n_steps", "async_save", "consolidate"),
    "sdc": ("every_n_steps", "action"),
}
#: The flat keys of the rejoin section: ``rejoin_standbys`` is ``rejoin.standbys``. Apart from ``_FLAT``
#: because ``rejoin`` itself, unlike ``checkpoint`` and ``sdc``, has a short form (the bool switch)
#: that goes with them, and because mappings (YAML written before the section) take them as well.
_REJOIN_SHORT: tuple[str, ...] = tuple(f"rejoin_{f.name}" for f in fields(RejoinConfig) if f.name != "enabled")

#: Every flat keyword the strategy (:meth:`RecoverConfig.build`) takes besides the fields: the short
#: forms of the sections. :class:`RecoverSettings` types each; a test keeps the two in step.
SHORT_FORMS: tuple[str, ...] = (*(f"{group}_{name}" for group, names in _FLAT.items() for name in names), *_REJOIN_SHORT)


def fold_short_forms(settings: Mapping[str, Any], *, flat_over_section: bool = False) -> dict[str, Any]:
    """``settings`` with the rejoin section's short forms put into ``rejoin`` (the other keys as given).

    ``rejoin=True``/``False`` becomes ``{"enabled": ...}`` and the flat ``rejoin_<name>`` keys
    become that section's ``<name>``; given with a section spelled out (a mapping or a
    RejoinConfig) they are refused as ambiguous, unless ``flat_over_section``: then the section
    holds defaults the flat keys override (a Hydra group, whose YAML spells every key of the
    section while a user adds ``+recover.rejoin_standbys=2``).
    """
    values = dict(settings)
    flat = {key[len("rejoin_"):]: values.pop(key) for key in _REJOIN_SHORT if key in values}
    section = values.get("rejoin")
    if isinstance(section, bool):
        values["rejoin"] = {"enabled": section, **flat}
    elif flat:
        if section is None:
            values["rejoin"] = flat
        elif flat_over_section and isinstance(section, Mapping):
            values["rejoin"] = {**section, **flat}
        else:
            keywords = ", ".join(f"rejoin_{name}" for name in flat)
            raise ConfigurationError(
                f"both rejoin=... and {keywords} set recover.rejoin; pass the section once: either "
                f"rejoin={{{', '.join(f'{n!r}: ...' for n in flat)}}} or rejoin=True/False with the flat rejoin_* keywords"
            )
    return values


class RecoverSettings(TypedDict, total=False):
    """The keyword settings of ReCoVerHSDPStrategy (and :meth:`RecoverConfig.build`), typed.

    ``**settings: Unpack[RecoverSettings]`` lets an IDE or a type checker refuse a misspelt
    keyword (and a value of the wrong type) before the run; :class:`RecoverConfig` refuses both
    at run time in any case. The keys are the RecoverConfig fields, each typed as the field plus
    what the builders also accept for it (a path-like for a path, a mapping or None for a
    section, a bool for ``rejoin``), and the short forms of :data:`SHORT_FORMS`. See
    :class:`RecoverConfig` for what each means; ``tests/launched/test_config.py`` keeps the
    keys equal to the fields plus the short forms.
    """

    shards: int
    grad_accum: int
    target_replicas: int | None
    policy: str
    min_replicas: int
    bucket_mb: float
    data_plane: str
    replica_plane: str
    ledger_path: str | os.PathLike[str] | None
    seed: int
    timeout_s: float
    hang_timeout_s: float | None
    stuck_timeout_s: float | None
    checkpoint: CheckpointConfig | Mapping[str, Any] | None
    sdc: SDCConfig | Mapping[str, Any] | None
    rejoin: RejoinConfig | bool | Mapping[str, Any] | None
    salvage: bool
    salvage_wait_s: float
    overlap: bool
    sync_every_microbatch: bool
    tensor_parallel: int
    # The short forms (SHORT_FORMS) of the sections.
    checkpoint_dir: str | os.PathLike[str] | None
    checkpoint_every_n_steps: int
    checkpoint_async_save: bool
    checkpoint_consolidate: bool
    sdc_every_n_steps: int
    sdc_action: str
    rejoin_hosts: str | None
    rejoin_attempts: int
    rejoin_backoff_s: float
    rejoin_timeout_s: float
    rejoin_standbys: int
    rejoin_standbys_wait_s: float


def _group(key: str, value: Any, group: type) -> Any:
    """A nested settings group (``recover.<key>``) from a mapping, None (its defaults) or an instance."""
    if value is None:
        return group()
    if isinstance(value, Mapping):
        return group(**_plain(f"recover.{key}", value, _names(group)))
    return value


def _plain(where: str, settings: Mapping[Any, Any], known: list[str]) -> dict[str, Any]:
    """``settings`` as a dict of known keys; an unknown key, or a value that cannot be read, is refused by name.

    Reading a value of an OmegaConf ``DictConfig`` can fail (``???`` not set, an
    interpolation that does not resolve); its message says which, but not as a
    ConfigurationError. Nested mappings are left to the group that reads them.
    """
    _check_keys(where or "recover", settings, known)
    values: dict[str, Any] = {}
    for key in settings:
        try:
            values[str(key)] = settings[key]
        except Exception as exc:  # OmegaConf's MissingMandatoryValue, InterpolationResolutionError, ...
            name = f"{where}.{key}" if where else f"recover.{key}"
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigurationError(f"{name} has no usable value ({first}); set {name} to a value") from None
    return values
