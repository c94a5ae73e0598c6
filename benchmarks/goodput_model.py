"""Goodput model of large-scale data-parallel pre-training under replica failures.

A discrete-event model behind ``benchmarks/simulate.py``; a benchmark tool that lives beside
it, not part of the installed package (the library never uses it). Pure standard library (no
numpy, torch or MPI; only :func:`pause_from_ledger` and :func:`rejoin_pause_from_ledger` read a
ledger with the package's reader),
so it imports anywhere and the tests can drive it directly. Times are seconds.

The job
-------
``N`` GPUs form ``W = N / g`` replicas of ``g`` GPUs each (one full model copy per replica,
HSDP). Fault-free, the job trains at rate 1: one second of wall time is one second of useful
work at the target global batch ``B``. **Goodput** is useful work / wall time, i.e. the
fraction of the fault-free rate a system achieves over the simulated window.

Failures
--------
Every GPU fails as an independent Poisson process with mean time between failures ``m``
(per-GPU MTBF), so the job sees failures at rate ``N / m`` (job MTBF ``M = m / N``).
A failure kills the whole replica that holds the GPU (the replica is the fault unit). In the
replica-based systems a failed replica is down for the repair time ``D``; failures drawn for
a GPU of a replica that is already down are absorbed (Poisson thinning), so every replica is
an independent alternating process: up ~ Exp(g/m), down ``D``. Failure types other than the
loss of a replica (whole-cluster outages, silent data corruption) are out of scope.

(a) Checkpoint-restart (TorchElastic / Lightning + checkpoints)
    The job alternates ``tau`` seconds of work and a blocking checkpoint write of ``delta``
    seconds. A failure anywhere (during work, the write, or a restart) loses everything since
    the last completed checkpoint and costs a restart ``R`` (re-init communicators, reload
    the checkpoint; a spare node takes the failed one's place, so the job always restarts at
    full size). A failure during a restart starts the restart over. This is exactly the model
    behind Daly's higher-order formula (J. T. Daly, FGCS 22(3), 2006): the expected wall time
    per segment of ``tau`` work is ``M e^{R/M} (e^{(tau+delta)/M} - 1)``, so the expected
    goodput is ``tau / (M e^{R/M} (e^{(tau+delta)/M} - 1))`` (``daly_goodput``). The first-order
    Young/Daly estimate of the waste is ``delta/tau + (tau/2 + R)/M`` (``first_order_waste``),
    minimised by ``tau = sqrt(2 delta M)`` (``young_daly_interval``, the default); Daly's
    higher-order optimum is available as ``daly_interval``.

(b) AdaptiveWorld (torchft-like)
    No restart. A failure stalls the whole job for the detection timeout (the survivors block
    in the all-reduce until the timeout fires), then the survivors continue with the same
    per-replica batch: the global batch is ``(W_cur / W) * B`` (it divides by the survivors),
    so the sample rate is ``W_cur / W`` and the batch drifts from the target. A repaired replica
    re-joins after ``D`` (a short re-join pause for the communicator rebuild; its weights are
    streamed off the critical path). We credit AdaptiveWorld with every sample it trains on
    (goodput in samples), and report the batch-size drift separately: the mean and the minimum
    fraction of the target batch its steps used, and the share of steps at the full batch.

(c) ReCoVer (lightning-recover)
    No restart. A failure stalls the job for the measured per-fault pause (ULFM detection,
    shrink, agree, and re-reducing stale buckets and replaying the dead replica's microbatches
    in the faulted step), then every step still commits exactly ``B`` samples. With fewer
    replicas each step takes longer: per-step compute per survivor grows by ``W / W_cur``, so
    the rate is ``W_cur / W`` (fluid limit, ``fluid_throughput``). With an integer number of
    accumulation steps ``G`` the step time is quantised (a survivor runs
    ``G_cur = ceil(W G / W_cur)`` microbatches) and the rate is ``G / G_cur``
    (``quantised_throughput``). An optional fault-free overhead fraction scales ReCoVer's rate.
    Two ReCoVer systems are simulated side by side (``JobResult.recover_no_rejoin`` and
    ``JobResult.recover``):

    * **without re-join** (``D = inf``): the paper's ReCoVer, and lightning-recover without
      ``rejoin=True``: the world only shrinks, so lost replicas accumulate over the window;
    * **with re-join** (lightning-recover's hot re-join): a replacement replica joins after
      ``D`` (the repair or allocation of a node; the joiner's start-up and state transfer run
      beside the survivors' training) and each join stalls the survivors for ReCoVer's own
      join pause (``ModelParams.recover_rejoin_pause_s``, measured from a ledger's ``joins`` by
      ``rejoin_pause_from_ledger``; by default the same assumed pause as (b)).

Pauses are serial: a failure during a pause extends it. While all replicas of a replica-based
job are down it makes no progress (its state is assumed to survive, e.g. in an occasional
checkpoint; this never happens at the default sizes). At the end of the window, work in
progress is credited as far as it got (the horizon is not a failure); the bias is
``O(tau / wall)``.
"""

from __future__ import annotations

import math
import os
import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CheckpointRestartRun",
    "JobResult",
    "ModelParams",
    "ReplicaRun",
    "Stat",
    "Throughput",
    "checkpoint_interval",
    "daly_goodput",
    "daly_interval",
    "first_order_waste",
    "fluid_throughput",
    "job_mtbf_s",
    "make_rng",
    "pause_from_ledger",
    "quantised_throughput",
    "rejoin_pause_from_ledger",
    "replica_goodput_estimate",
    "simulate_checkpoint_restart",
    "simulate_job",
    "simulate_replicas",
    "young_daly_interval",
]

HOUR = 3600.0
DAY = 24 * HOUR
# One simulated run may not need more events than this (a job MTBF far below the restart
# cost, or a tiny per-GPU MTBF, would otherwise make a run spin for minutes).
MAX_EVENTS = 20_000_000

Throughput = Callable[[int, int], float]
"""``throughput(alive, total)``: fraction of the fault-free sample rate with ``alive`` of
``total`` replicas up."""


# --------------------------------------------------------------------------------------------
# argument checks


def _check_time(name: str, value: float, *, positive: bool = False, allow_inf: bool = False) -> float:
    """``value`` as a float, or a ValueError that names ``name`` and the bad value."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds (got {value!r})") from None
    if math.isnan(v):
        raise ValueError(f"{name} must be a number (got NaN)")
    if math.isinf(v) and not allow_inf:
        raise ValueError(f"{name} must be finite (got {v})")
    if positive and not v > 0:
        raise ValueError(f"{name} must be > 0 (got {value!r})")
    if not positive and v < 0:
        raise ValueError(f"{name} must be >= 0 (got {value!r})")
    return v


def _check_int(name: str, value: int, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer (got {value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {value})")
    return value


# --------------------------------------------------------------------------------------------
# closed forms


def job_mtbf_s(gpus: int, gpu_mtbf_s: float) -> float:
    """Job MTBF ``M = m / N`` of ``gpus`` GPUs failing independently with MTBF ``gpu_mtbf_s``."""
    _check_int("gpus", gpus, minimum=1)
    m = _check_time("gpu_mtbf_s", gpu_mtbf_s, positive=True, allow_inf=True)
    return m / gpus


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """First-order optimal checkpoint interval ``sqrt(2 delta M)`` (Young 1974, Daly 2006)."""
    d = _check_time("checkpoint_s", checkpoint_s, positive=True)
    m = _check_time("mtbf_s", mtbf_s, positive=True, allow_inf=True)
    return math.sqrt(2.0 * d * m)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal interval (Daly 2006, eq. 37).

    ``sqrt(2 delta M) [1 + sqrt(delta/2M)/3 + (delta/2M)/9] - delta`` for ``delta < 2M``,
    else ``M``.
    """
    d = _check_time("checkpoint_s", checkpoint_s, positive=True)
    m = _check_time("mtbf_s", mtbf_s, positive=True, allow_inf=True)
    if math.isinf(m):
        return math.inf
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def checkpoint_interval(rule: str, checkpoint_s: float, mtbf_s: float) -> float:
    """The checkpoint interval by ``rule``: ``"young"`` (sqrt(2 delta M)) or ``"daly"``."""
    if rule == "young":
        return young_daly_interval(checkpoint_s, mtbf_s)
    if rule == "daly":
        return daly_interval(checkpoint_s, mtbf_s)
    raise ValueError(f"interval rule must be 'young' or 'daly' (got {rule!r})")


def daly_goodput(mtbf_s: float, tau_s: float, checkpoint_s: float, restart_s: float) -> float:
    """Expected goodput of checkpoint-restart by Daly's higher-order formula.

    ``tau / (M e^{R/M} (e^{(tau+delta)/M} - 1))``: exact, in expectation, for the model of
    ``simulate_checkpoint_restart`` (exponential failures that can strike work, checkpoint
    writes and restarts alike).
    """
    m = _check_time("mtbf_s", mtbf_s, positive=True, allow_inf=True)
    tau = _check_time("tau_s", tau_s, positive=True, allow_inf=True)
    d = _check_time("checkpoint_s", checkpoint_s)
    r = _check_time("restart_s", restart_s)
    if math.isinf(m):
        return 1.0 if math.isinf(tau) else tau / (tau + d)
    if math.isinf(tau):
        return 0.0  # never checkpoints, so a failure always loses everything
    try:
        wall = m * math.exp(r / m) * math.expm1((tau + d) / m)
    except OverflowError:
        return 0.0
    return tau / wall if math.isfinite(wall) else 0.0


def first_order_waste(mtbf_s: float, tau_s: float, checkpoint_s: float, restart_s: float) -> float:
    """Young/Daly first-order waste fraction ``delta/tau + (tau/2 + R)/M``.

    Valid when ``tau``, ``delta`` and ``R`` are all much smaller than ``M``; goodput is about
    ``1 - waste`` there.
    """
    m = _check_time("mtbf_s", mtbf_s, positive=True, allow_inf=True)
    tau = _check_time("tau_s", tau_s, positive=True, allow_inf=True)
    d = _check_time("checkpoint_s", checkpoint_s)
    r = _check_time("restart_s", restart_s)
    ckpt = 0.0 if math.isinf(tau) else d / tau
    if math.isinf(m):
        return ckpt
    return ckpt + (tau / 2.0 + r) / m


def fluid_throughput(alive: int, total: int) -> float:
    """Sample rate with ``alive`` of ``total`` replicas: ``alive / total`` (work divides evenly)."""
    return alive / total if total else 0.0


def quantised_throughput(grad_accum: int) -> Throughput:
    """ReCoVer's rate with ``grad_accum`` = G initial accumulation steps (B = total * G).

    A survivor runs ``G_cur = ceil(B / alive)`` microbatches, so a step takes ``G_cur / G`` of
    the fault-free step time and the rate is ``G / G_cur``.
    """
    g = _check_int("grad_accum", grad_accum, minimum=1)

    def throughput(alive: int, total: int) -> float:
        if alive <= 0:
            return 0.0
        return g / -(-(total * g) // alive)

    return throughput


def replica_goodput_estimate(
    gpus: int,
    gpus_per_replica: int,
    gpu_mtbf_s: float,
    pause_s: float,
    repair_s: float,
    rejoin_pause_s: float,
    wall_s: float,
) -> float:
    """Analytic goodput of a replica-based system in the fluid limit (for cross-checks).

    Each replica is up a fraction ``P = m / (m + g D)`` of the time (stationary alternating
    process; with ``D = inf`` the average of ``e^{-g t/m}`` over the window). Failures that
    count arrive at ``N P / m`` and so do re-joins; each stalls the job for its pause. Assumes
    pauses rarely overlap and are independent of the replica count:
    ``goodput ~ (1 - rate * (pause + rejoin_pause)) * P``.
    """
    _check_int("gpus", gpus, minimum=1)
    g = _check_int("gpus_per_replica", gpus_per_replica, minimum=1)
    m = _check_time("gpu_mtbf_s", gpu_mtbf_s, positive=True, allow_inf=True)
    p = _check_time("pause_s", pause_s)
    d = _check_time("repair_s", repair_s, allow_inf=True)
    pr = _check_time("rejoin_pause_s", rejoin_pause_s)
    t = _check_time("wall_s", wall_s, positive=True)
    if math.isinf(m):
        return 1.0
    if math.isinf(d):
        k = g * t / m
        up = -math.expm1(-k) / k
        stall = (gpus / m) * up * p
    else:
        up = m / (m + g * d)
        stall = (gpus / m) * up * (p + pr)
    return max(0.0, 1.0 - stall) * up


# --------------------------------------------------------------------------------------------
# event simulation


def make_rng(*key: object) -> random.Random:
    """A deterministic generator for ``key`` (e.g. seed, system, job size, repetition)."""
    return random.Random("/".join(map(str, key)))


def _expo(rng: random.Random, mean: float) -> float:
    return math.inf if math.isinf(mean) else rng.expovariate(1.0 / mean)


def _check_events(expected: float, what: str) -> None:
    if expected > MAX_EVENTS:
        raise ValueError(
            f"{what} would need about {expected:.3g} events (limit {MAX_EVENTS:.3g}): the failure "
            f"rate is too high for the simulated wall time; shorten the wall time or raise the MTBF"
        )


@dataclass(frozen=True)
class CheckpointRestartRun:
    """One simulated checkpoint-restart window."""

    goodput: float
    failures: int
    checkpoints: int
    restarts_s: float  # wall time spent in (possibly interrupted) restarts
    lost_s: float  # work and checkpoint writes lost to failures


def simulate_checkpoint_restart(
    mtbf_s: float,
    tau_s: float,
    checkpoint_s: float,
    restart_s: float,
    wall_s: float,
    rng: random.Random,
) -> CheckpointRestartRun:
    """Simulate checkpoint-restart with job MTBF ``mtbf_s`` over ``wall_s`` seconds.

    Segments of ``tau_s`` work followed by a ``checkpoint_s`` write; a failure anywhere loses
    the segment and costs ``restart_s`` (itself interruptible by failures). See the module
    docstring; in expectation this matches ``daly_goodput``.
    """
    m = _check_time("mtbf_s", mtbf_s, positive=True, allow_inf=True)
    tau = _check_time("tau_s", tau_s, positive=True, allow_inf=True)
    d = _check_time("checkpoint_s", checkpoint_s)
    r = _check_time("restart_s", restart_s)
    wall = _check_time("wall_s", wall_s, positive=True)
    seg = tau + d
    _check_events(wall / min(m, seg), "the checkpoint-restart simulation")
    t = work = lost = restarts = 0.0
    failures = checkpoints = 0
    while t < wall:
        x = _expo(rng, m)
        if x >= seg or t + x >= wall:  # the segment survives (or the window ends first)
            if t + seg > wall:
                work += min(tau, wall - t)
                break
            t += seg
            work += tau
            checkpoints += 1
            continue
        t += x
        failures += 1
        lost += x
        while t < wall:  # restart; a failure during it starts it over
            y = _expo(rng, m)
            if y >= r:
                restarts += min(r, wall - t)
                t += r
                break
            if t + y < wall:
                failures += 1
            restarts += min(y, wall - t)
            t += y
    return CheckpointRestartRun(min(1.0, work / wall), failures, checkpoints, restarts, lost)


@dataclass(frozen=True)
class ReplicaRun:
    """One simulated window of a replica-based system (AdaptiveWorld or ReCoVer)."""

    goodput: float
    failures: int  # replica losses (failures absorbed by a replica already down excluded)
    rejoins: int
    paused_s: float
    batch_fraction_mean: float  # step-weighted mean of alive / total
    batch_fraction_min: float
    full_batch_share: float  # share of running time with every replica up


def simulate_replicas(
    n_replicas: int,
    gpus_per_replica: int,
    gpu_mtbf_s: float,
    pause_s: float,
    repair_s: float,
    rejoin_pause_s: float,
    wall_s: float,
    rng: random.Random,
    throughput: Throughput = fluid_throughput,
    rate_scale: float = 1.0,
    salvage: bool = False,
) -> ReplicaRun:
    """Simulate a system that continues through replica losses, over ``wall_s`` seconds.

    Failures arrive at ``n_replicas * gpus_per_replica / gpu_mtbf_s``; each picks a uniform
    replica and kills it if it is up (then it is down for ``repair_s`` and re-joins). Each loss
    stalls the job for ``pause_s``, each re-join for ``rejoin_pause_s``. Between stalls the job
    progresses at ``rate_scale * throughput(alive, n_replicas)``.

    ``salvage`` (lightning-recover's ``recover.salvage``): a failure takes one GPU, of a uniform
    shard index; the replica's other GPUs wait as orphans, and whenever the orphans hold every
    shard index a whole replica re-forms from them (a join: ``rejoin_pause_s``). The failed GPU
    alone comes back after ``repair_s`` (re-join spawns only the missing rank), as an orphan of
    its index. A failure of an orphan's GPU costs no pause (it was in no world); one of a GPU
    in repair changes nothing.
    """
    w = _check_int("n_replicas", n_replicas, minimum=1)
    g = _check_int("gpus_per_replica", gpus_per_replica, minimum=1)
    m = _check_time("gpu_mtbf_s", gpu_mtbf_s, positive=True, allow_inf=True)
    p = _check_time("pause_s", pause_s)
    d = _check_time("repair_s", repair_s, allow_inf=True)
    pr = _check_time("rejoin_pause_s", rejoin_pause_s)
    wall = _check_time("wall_s", wall_s, positive=True)
    scale = float(rate_scale)
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"rate_scale must be in [0, 1] (got {rate_scale!r})")
    fail_mean = m / (w * g)
    _check_events(2.0 * wall / fail_mean, "the replica simulation")

    t = work = paused = 0.0
    pause_until = 0.0
    alive = w
    down: deque[tuple[float, int]] = deque()  # (repair completion time, shard index), in order (D is constant)
    orphans = [0] * g  # salvage: waiting GPUs by shard index
    failures = rejoins = 0
    running = frac_time = full_time = 0.0
    min_alive = w
    rate = scale * throughput(alive, w)
    next_fail = _expo(rng, fail_mean)
    while True:
        next_rep = down[0][0] if down else math.inf
        t_next = min(next_fail, next_rep, wall)
        start = max(t, pause_until)
        if t_next > start:
            dt = t_next - start
            work += dt * rate
            if alive:
                running += dt
                frac_time += dt * alive
                if alive == w:
                    full_time += dt
        if pause_until > t:
            paused += min(pause_until, t_next) - t
        t = t_next
        if t >= wall:
            break
        if next_rep <= next_fail:
            _, shard = down.popleft()
            if salvage:
                orphans[shard] += 1
            else:
                alive += 1
                rejoins += 1
                pause_until = max(pause_until, t) + pr
        else:
            if rng.random() * w < alive:  # the failed GPU belongs to a replica that is up
                alive -= 1
                failures += 1
                min_alive = min(min_alive, alive)
                shard = rng.randrange(g) if salvage else 0
                for s in range(g) if salvage else ():
                    orphans[s] += s != shard
                down.append((t + d, shard))
                pause_until = max(pause_until, t) + p
            elif salvage and (hit := rng.random() * (w - alive) * g) < sum(orphans):
                shard = next(s for s in range(g) if (hit := hit - orphans[s]) < 0)
                orphans[shard] -= 1  # an orphan's GPU: no world to pause
                down.append((t + d, shard))
            next_fail = t + _expo(rng, fail_mean)
        while salvage and min(orphans) > 0:  # the orphans hold every shard index: a replica re-forms
            for s in range(g):
                orphans[s] -= 1
            alive += 1
            rejoins += 1
            pause_until = max(pause_until, t) + pr
        rate = scale * throughput(alive, w)
    return ReplicaRun(
        goodput=min(1.0, work / wall),  # min: float rounding of the summed intervals
        failures=failures,
        rejoins=rejoins,
        paused_s=paused,
        batch_fraction_mean=min(1.0, frac_time / running / w) if running else 1.0,
        batch_fraction_min=min_alive / w,
        full_batch_share=(full_time / running) if running else 1.0,
    )


# --------------------------------------------------------------------------------------------
# one job size, three systems, repetitions


@dataclass(frozen=True)
class ModelParams:
    """Everything but the job size; times in seconds. Validated on construction."""

    gpu_mtbf_s: float = 50_000 * HOUR
    gpus_per_replica: int = 8
    restart_s: float = 600.0
    checkpoint_s: float = 60.0
    recover_pause_s: float = 0.05
    adaptive_pause_s: float = 60.0
    repair_s: float = 1800.0
    rejoin_pause_s: float = 5.0
    interval: str = "young"
    grad_accum: int = 0  # 0: fluid limit (work divides evenly among survivors)
    recover_overhead: float = 0.0  # ReCoVer's fault-free step-time overhead, as a fraction
    # ReCoVer's own join pause (measured from a ledger); None: the assumed rejoin_pause_s,
    # which AdaptiveWorld always uses.
    recover_rejoin_pause_s: float | None = None
    # FT-HSDP (Meta): its published stall per failure (3 minutes at 100k GPUs); the batch
    # shrinks while a replica is away, as AdaptiveWorld's.
    ft_hsdp_pause_s: float = 180.0

    def __post_init__(self) -> None:
        _check_time("gpu_mtbf_s", self.gpu_mtbf_s, positive=True, allow_inf=True)
        _check_int("gpus_per_replica", self.gpus_per_replica, minimum=1)
        _check_time("restart_s", self.restart_s)
        _check_time("checkpoint_s", self.checkpoint_s, positive=True)
        _check_time("recover_pause_s", self.recover_pause_s)
        _check_time("adaptive_pause_s", self.adaptive_pause_s)
        _check_time("repair_s", self.repair_s, allow_inf=True)
        _check_time("rejoin_pause_s", self.rejoin_pause_s)
        _check_time("ft_hsdp_pause_s", self.ft_hsdp_pause_s)
        if self.recover_rejoin_pause_s is not None:
            _check_time("recover_rejoin_pause_s", self.recover_rejoin_pause_s)
        if self.interval not in ("young", "daly"):
            raise ValueError(f"interval must be 'young' or 'daly' (got {self.interval!r})")
        _check_int("grad_accum", self.grad_accum, minimum=0)
        o = self.recover_overhead
        if not (isinstance(o, (int, float)) and 0.0 <= o < 1.0):
            raise ValueError(f"recover_overhead must be a fraction in [0, 1) (got {o!r})")

    @property
    def recover_join_pause_s(self) -> float:
        """The stall ReCoVer's survivors take per join: measured if given, else ``rejoin_pause_s``."""
        return self.rejoin_pause_s if self.recover_rejoin_pause_s is None else self.recover_rejoin_pause_s


@dataclass(frozen=True)
class Stat:
    """Mean, sample standard deviation and 95% confidence half-width over repetitions."""

    mean: float
    std: float
    ci95: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        n = len(values)
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if n > 1 else 0.0
        return cls(mean, std, 1.96 * std / math.sqrt(n) if n else 0.0, n)


@dataclass(frozen=True)
class JobResult:
    """The three systems on one job size (ReCoVer with and without re-join)."""

    gpus: int
    replicas: int
    job_mtbf_s: float
    tau_s: float
    checkpoint_restart: Stat
    daly_goodput: float
    first_order_goodput: float
    adaptive: Stat
    adaptive_batch_mean: Stat
    adaptive_batch_min: Stat
    adaptive_full_batch_share: Stat
    recover: Stat  # with re-join after repair_s (the same as recover_no_rejoin when repair_s is inf)
    recover_estimate: float
    recover_no_rejoin: Stat  # repair_s = inf: the world only shrinks
    recover_no_rejoin_estimate: float
    failures_per_run: float
    extra: dict[str, Any] = field(default_factory=dict)
    #: FT-HSDP: ``ft_hsdp_pause_s`` per failure, a shrinking batch (None when not simulated).
    ft_hsdp: Stat | None = None
    #: ReCoVer with ``recover.salvage`` (:func:`simulate_replicas`), with re-join and without (None: not simulated).
    recover_salvage: Stat | None = None
    recover_salvage_no_rejoin: Stat | None = None

    @property
    def ratio(self) -> float:
        """ReCoVer (with re-join) / checkpoint-restart goodput (inf when checkpoint-restart makes no progress)."""
        cr = self.checkpoint_restart.mean
        return self.recover.mean / cr if cr > 0 else math.inf

    @property
    def ratio_no_rejoin(self) -> float:
        """ReCoVer without re-join / checkpoint-restart goodput (inf when checkpoint-restart makes no progress)."""
        cr = self.checkpoint_restart.mean
        return self.recover_no_rejoin.mean / cr if cr > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio_recover_over_checkpoint_restart"] = self.ratio
        out["ratio_recover_no_rejoin_over_checkpoint_restart"] = self.ratio_no_rejoin
        return out


def simulate_job(gpus: int, params: ModelParams, wall_s: float, reps: int, seed: int = 0) -> JobResult:
    """Simulate ``reps`` windows of ``wall_s`` seconds of a ``gpus``-GPU job for all three systems.

    ReCoVer runs twice per window on the same failure stream (the same seed): with re-join
    (``params.repair_s``, ``params.recover_join_pause_s``) and without (``repair_s = inf``).
    """
    _check_int("gpus", gpus, minimum=1)
    _check_int("reps", reps, minimum=1)
    _check_time("wall_s", wall_s, positive=True)
    g = params.gpus_per_replica
    if gpus % g:
        raise ValueError(
            f"job size {gpus} GPUs is not a multiple of gpus_per_replica={g}; choose sizes that "
            f"split into whole replicas"
        )
    w = gpus // g
    m_job = job_mtbf_s(gpus, params.gpu_mtbf_s)
    tau = checkpoint_interval(params.interval, params.checkpoint_s, m_job)
    thr = quantised_throughput(params.grad_accum) if params.grad_accum else fluid_throughput
    rejoins = not math.isinf(params.repair_s)
    cr, aw, rc, rc_shrink, ft, sv, sv_shrink = [], [], [], [], [], [], []
    for rep in range(reps):
        ft.append(
            simulate_replicas(
                w, g, params.gpu_mtbf_s, params.ft_hsdp_pause_s, params.repair_s, params.rejoin_pause_s,
                wall_s, make_rng(seed, "ft", gpus, rep),
            )
        )
        cr.append(
            simulate_checkpoint_restart(
                m_job, tau, params.checkpoint_s, params.restart_s, wall_s, make_rng(seed, "cr", gpus, rep)
            )
        )
        aw.append(
            simulate_replicas(
                w, g, params.gpu_mtbf_s, params.adaptive_pause_s, params.repair_s, params.rejoin_pause_s,
                wall_s, make_rng(seed, "aw", gpus, rep),
            )
        )
        rc_shrink.append(
            simulate_replicas(
                w, g, params.gpu_mtbf_s, params.recover_pause_s, math.inf, params.recover_join_pause_s,
                wall_s, make_rng(seed, "rc", gpus, rep), throughput=thr,
                rate_scale=1.0 - params.recover_overhead,
            )
        )
        for repair, runs, salvage in ((params.repair_s, rc, False), (params.repair_s, sv, True), (math.inf, sv_shrink, True)):
            if rejoins or repair == math.inf:
                runs.append(
                    simulate_replicas(
                        w, g, params.gpu_mtbf_s, params.recover_pause_s, repair, params.recover_join_pause_s,
                        wall_s, make_rng(seed, "rc", gpus, rep), throughput=thr,
                        rate_scale=1.0 - params.recover_overhead, salvage=salvage,
                    )
                )
    if not rejoins:  # repair_s = inf: the system with re-join is the one without
        rc, sv = rc_shrink, sv_shrink
    daly = daly_goodput(m_job, tau, params.checkpoint_s, params.restart_s)
    first = max(0.0, 1.0 - first_order_waste(m_job, tau, params.checkpoint_s, params.restart_s))
    est, est_shrink = (
        (1.0 - params.recover_overhead)
        * replica_goodput_estimate(
            gpus, g, params.gpu_mtbf_s, params.recover_pause_s, repair, params.recover_join_pause_s, wall_s
        )
        for repair in (params.repair_s, math.inf)
    )
    return JobResult(
        gpus=gpus,
        replicas=w,
        job_mtbf_s=m_job,
        tau_s=tau,
        checkpoint_restart=Stat.of([r.goodput for r in cr]),
        daly_goodput=daly,
        first_order_goodput=first,
        adaptive=Stat.of([r.goodput for r in aw]),
        adaptive_batch_mean=Stat.of([r.batch_fraction_mean for r in aw]),
        adaptive_batch_min=Stat.of([r.batch_fraction_min for r in aw]),
        adaptive_full_batch_share=Stat.of([r.full_batch_share for r in aw]),
        recover=Stat.of([r.goodput for r in rc]),
        recover_estimate=est if params.grad_accum == 0 else math.nan,
        recover_no_rejoin=Stat.of([r.goodput for r in rc_shrink]),
        recover_no_rejoin_estimate=est_shrink if params.grad_accum == 0 else math.nan,
        failures_per_run=statistics.fmean(r.failures for r in rc),
        ft_hsdp=Stat.of([r.goodput for r in ft]),
        recover_salvage=Stat.of([r.goodput for r in sv]),
        recover_salvage_no_rejoin=Stat.of([r.goodput for r in sv_shrink]),
        extra={
            "checkpoint_restart_failures_per_run": statistics.fmean(r.failures for r in cr),
            "checkpoint_restart_restart_s_per_run": statistics.fmean(r.restarts_s for r in cr),
            "adaptive_paused_s_per_run": statistics.fmean(r.paused_s for r in aw),
            "recover_paused_s_per_run": statistics.fmean(r.paused_s for r in rc),
            "recover_rejoins_per_run": statistics.fmean(r.rejoins for r in rc),
            "recover_no_rejoin_paused_s_per_run": statistics.fmean(r.paused_s for r in rc_shrink),
            "recover_no_rejoin_live_fraction_min": statistics.fmean(r.batch_fraction_min for r in rc_shrink),
            "recover_salvage_reformations_per_run": statistics.fmean(r.rejoins for r in sv),
            "recover_salvage_no_rejoin_live_fraction_min": statistics.fmean(r.batch_fraction_min for r in sv_shrink),
            "recover_batch_fraction_mean": 1.0,  # constant B by construction
        },
    )


def pause_from_ledger(path: str | os.PathLike[str]) -> tuple[float, int]:
    """Measured per-fault pause from a lightning-recover step ledger (JSON lines).

    Returns the mean ``recovery_s`` over the faulted steps (non-empty ``faults``) whose
    ``recovery_s`` is nonzero, and how many such steps there were. ``recovery_s`` is the time
    from the failed reduce to the commit of the step: repair, re-planning, replayed
    microbatches and the re-reduction of stale buckets (not the time to detect a hung rank).
    """
    from lightning_recover.audit.ledger import read_ledger

    values: list[float] = []
    for rec in read_ledger(path):
        faults = rec.get("faults")
        if faults is not None and not faults:
            continue
        v = rec.get("recovery_s")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
            values.append(float(v))
    if not values:
        raise ValueError(
            f"{os.fspath(path)}: no faulted step with a nonzero recovery_s; pass the ledger of a "
            f"run with injected faults, or give the pause with --pause-s"
        )
    return statistics.fmean(values), len(values)


def rejoin_pause_from_ledger(path: str | os.PathLike[str]) -> tuple[float, int] | None:
    """Measured join pause from a lightning-recover step ledger with hot re-join (JSON lines).

    Returns the median ``pause_s`` (the seconds the survivors were blocked by one join) over
    every entry of every record's ``joins`` list that has one, and how many entries that was;
    None when the ledger records no join with a measured pause (a run without
    ``rejoin=True``, or whose joins all have ``pause_s`` null). The median, not the mean: one
    join that met a fault in its transfer would otherwise stand for all of them.
    """
    from lightning_recover.audit.ledger import read_ledger

    values: list[float] = []
    for rec in read_ledger(path):
        joins = rec.get("joins") or []
        if not isinstance(joins, list):
            raise ValueError(
                f"{os.fspath(path)}: step {rec.get('step')}: joins must be a list, got {joins!r}; "
                f"run `lightning-recover check-ledger {os.fspath(path)}`"
            )
        for j in joins:
            if not isinstance(j, dict):
                raise ValueError(
                    f"{os.fspath(path)}: step {rec.get('step')}: each join must be an object, got {j!r}; "
                    f"run `lightning-recover check-ledger {os.fspath(path)}`"
                )
            v = j.get("pause_s")
            if v is None:
                continue  # not measured (e.g. the join met a fault)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(
                    f"{os.fspath(path)}: step {rec.get('step')}: join pause_s must be seconds >= 0 "
                    f"or null, got {v!r}; run `lightning-recover check-ledger {os.fspath(path)}`"
                )
            values.append(float(v))
    if not values:
        return None
    return statistics.median(values), len(values)
