"""The chaos campaign's draws, predictions and judgements, shared by ``python -m benchmarks.chaos`` and the tests.

The campaign (``python -m benchmarks.chaos``, whose docstring states every invariant it
checks) kills, stops and corrupts ranks of real launched jobs at random and judges every
run. What it draws and how it judges lives here, so that the tests check the very code
the campaign runs, without launching anything:

* :func:`draw_run` draws one run on this machine: a topology that fits 2 cores
  (:data:`TOPOLOGIES`), then up to W - 1 replica losses in random phases, kinds and
  timings, optionally faults on re-join replacements (:data:`JOIN_PHASES`) and one bit
  flip; :func:`draw_host_run` draws one run on fake hosts with one host fault
  (:data:`HOST_FAULT_KINDS`) and its :class:`Prediction`.
* :func:`predict` replays a run's faults through the no-split-brain rule
  (:func:`lightning_recover.comm.quorum.decide`) with the inputs the survivors have, and says
  whether the head's side must go on in place or stop for want of quorum, and which last
  world it must end with. Draws whose outcome the campaign cannot judge are refused.
* :class:`Outcome` is one run's verdict (violations, split brains, what fired and was
  recovered); :func:`status_markers` and :func:`read_attempts` read what the ranks and the
  supervisor left of a run; :func:`summary` is the campaign's closing table.

Every draw is a pure function of its ``random.Random``: a seed gives the same runs on any
machine. Nothing here imports Lightning or launches a process; the launched job, the
fault-free reference and the driver stay in ``benchmarks/chaos.py`` (they train the
example GPT of the checkout's ``examples/``).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

#: (replicas, shards, target replicas) that fit a 2-core machine.
TOPOLOGIES: tuple[tuple[int, int, int | None], ...] = ((4, 1, None), (2, 2, None), (5, 1, 4), (3, 1, None), (4, 1, 3))
#: ``--salvage``: replicas of 2 shards, so that a lost rank leaves an orphan (3 x 2: two broken replicas may re-form one).
SALVAGE_TOPOLOGIES: tuple[tuple[int, int, int | None], ...] = ((2, 2, None), (3, 2, None), (3, 2, 2))
#: What salvage did in a run, from the leader's and the orphans' lines (counted by the summary).
SALVAGE_EVENTS: dict[str, str] = {
    "replica re-formed from orphans alone": "(salvage: no process spawned)",
    "replica completed by spawned ranks": "spawned by the orphans, not",
    "orphan dismissed unseated": "an orphan not seated",
}
PHASES = ("forward", "backward", "reduce", "optimizer")


@dataclass
class ChaosRun:
    """One drawn run: its topology (replicas x shards, a target below the replicas leaves spares), microbatching,
    seed and faults (FaultInjection specs), and where it runs (fake hosts, or this machine)."""

    index: int
    replicas: int
    shards: int
    target: int | None
    grad_accum: int
    steps: int
    seed: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    rejoin: bool = False
    #: ``recover.salvage``: a broken replica's live ranks wait as orphans (``--salvage``).
    salvage: bool = False
    #: Warm standbys kept with ``rejoin`` (``recover.rejoin.standbys``; a campaign setting, never drawn).
    standbys: int = 0
    #: Fake hosts the run uses (0: this machine, no fake hosts) and MPI slots on each.
    hosts: int = 0
    slots: int = 0

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    @property
    def B(self) -> int:
        return (self.target or self.replicas) * self.grad_accum

    def describe(self) -> str:
        t = f" T={self.target}" if self.target else ""
        fs = ", ".join(
            f"s{f['step']} r{f['rank']} {f['phase']}{'/mb' + str(f['microbatch']) if 'microbatch' in f else ''} {f['kind']}"
            + (f" {f['seconds']:g}s" if "seconds" in f else "")
            for f in self.faults
        )
        where = f" on {self.hosts} hosts x {self.slots}" if self.hosts else ""
        return f"{self.replicas}x{self.shards}{t}{where} G={self.grad_accum} B={self.B}{' rejoin' if self.rejoin else ''}{' salvage' if self.salvage else ''}{f' standbys={self.standbys}' if self.standbys else ''}: {fs}"

    def host_of(self, rank: int) -> int:
        """The fake host (index) ``rank`` runs on: Open MPI fills each host's slots in turn."""
        if not self.hosts:
            raise ValueError("host_of applies to runs on fake hosts (--hosts N)")
        return rank // self.slots


#: Re-join phases a replacement can be killed in (FaultInjection counts their step by attempt).
JOIN_PHASES = ("join_startup", "join_transfer", "joined")


def draw_run(
    index: int, rng: random.Random, steps: int, hangs: bool = True, stuck: bool = False, joins: bool = False, corrupt: bool = False,
    terms: bool = False, salvage: bool = False,
) -> ChaosRun:
    """One random run. A fifth of the faults are silent (SIGSTOP, or with ``stuck`` half of
    those spin in compute instead); ``stuck`` does not change the other draws of a seed.
    With ``terms`` half of the kills are SIGTERMs instead (mpiexec ending ranks, a node
    drained), which must cost what a kill costs; it too leaves the rest of the draw alone.
    ``joins`` turns re-join on and adds faults on replacements, ``corrupt`` adds one bit
    flip (both drawn after the others, so the rest of a seed's draw is the same). ``salvage``
    turns salvage on and draws from :data:`SALVAGE_TOPOLOGIES`; with ``joins`` the replacement
    faults then also hit seated orphans and the ranks they spawn (they run the script as replacements)."""
    W, S, T = rng.choice(SALVAGE_TOPOLOGIES if salvage else TOPOLOGIES)
    run = ChaosRun(index, W, S, T, grad_accum=rng.randint(1, 3), steps=steps, seed=rng.randint(0, 2**31 - 1), salvage=salvage)
    losses = rng.randint(1, W - 1)
    victims = rng.sample(range(W), losses)
    for n, replica in enumerate(victims):
        rank = replica * S + rng.randrange(S)
        step = rng.randrange(steps)
        phase = rng.choice(PHASES)
        r = rng.random()
        kind = "kill" if not hangs or r >= 0.2 else ("stuck" if stuck and r >= 0.1 else "hang")
        if kind == "kill" and terms and r >= 0.6:
            kind = "term"
        fault: dict[str, Any] = {"step": step, "rank": rank, "phase": phase, "kind": kind}
        if phase in ("forward", "backward"):
            # Indices past the replica's own quota land in a boundary step (a cascade).
            fault["microbatch"] = rng.randrange(run.grad_accum + (2 if n else 0))
        elif phase == "reduce":
            fault["bucket"] = rng.randrange(3)
        run.faults.append(fault)
    if joins:
        run.rejoin = True
        for replica in victims:
            if rng.random() < 0.5:
                rank = replica * S + rng.randrange(S)
                run.faults.append({"step": rng.randint(1, 2), "rank": rank, "phase": rng.choice(JOIN_PHASES), "kind": "kill"})
    if corrupt and run.replicas >= 3:  # two replicas cannot tell which copy is right: that job stops (tested apart)
        rank = rng.randrange(run.world)
        target = rng.choice(("params", "optimizer", "grads"))
        spares = range((run.target or run.replicas) * S, run.world)
        quiet_step0 = not any(f["step"] == 0 for f in run.faults)
        if target == "grads" and run.grad_accum > 1 and spares and quiet_step0:
            # Mid-step, in a spare's shadow copy (the only copy the cross-check compares before the
            # reduction), in step 0, while no failure has changed the roles yet.
            run.faults.append({"step": 0, "rank": rng.choice(list(spares)), "phase": "backward", "microbatch": 1,
                               "kind": "corrupt", "target": "grads"})
        else:
            # A step where at least 3 replicas are certainly live (a majority can name the odd one);
            # the optimizer has no state before its first update (step 0).
            first = 1 if target == "optimizer" else 0
            ok = [t for t in range(first, steps) if run.replicas - sum(1 for f in run.faults if f["step"] <= t) >= 3]
            if ok:
                run.faults.append({"step": rng.choice(ok), "rank": rank, "phase": "optimizer",
                                   "kind": "corrupt", "target": "params" if target == "grads" else target})
    return run


# ---------------------------------------------------------------------- runs on fake hosts
#: (hosts, slots per host, replicas, shards) for ``--hosts N``: ranks fill each host in turn, every
#: replica lives on one host, at most 4 ranks (2 cores). Those needing more hosts than N are left out.
HOST_TOPOLOGIES: tuple[tuple[int, int, int, int], ...] = ((3, 1, 3, 1), (2, 2, 4, 1), (2, 2, 2, 2), (4, 1, 4, 1))
HOST_FAULT_KINDS = ("host_ranks_kill", "host_kill", "host_freeze", "host_partition", "host_flap")
#: Open MPI's heartbeat detector without its thread (which hung fault-free jobs at finalize): the
#: only way a cut-off or frozen host's ranks are noticed; a rank silent for 4 s is declared dead.
DETECTOR = ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "4"]
#: ``LIGHTNING_RECOVER_REPAIR_TIMEOUT`` of the runs on fake hosts: an agreement or repair that does
#: not return within it ends its rank as one without quorum (the supervisor relaunches). Above the
#: slowest in-place repair seen here (35 s: a frozen host's two ranks, declared one at a time).
REPAIR_BOUND_S = 45.0
#: How long after the cut a partitioned host's ranks may take to leave on their own: detection (4 s
#: per rank the detector declares, one at a time), then their repair, which the bound above ends
#: when their agreement never returns (seen on the cut-off side of an even split), on a loaded machine.
CUT_OFF_EXIT_BOUND_S = REPAIR_BOUND_S + 30.0
#: The supervisor's ``--stall-timeout``: no committed step for this long (counted from an attempt's
#: start) ends the attempt -- what ends a job whose mpiexec waits on a frozen host's daemon after
#: every rank it can reach has left. Above start-up plus :data:`REPAIR_BOUND_S` on a loaded machine.
STALL_TIMEOUT_S = 100.0


@dataclass(frozen=True)
class Prediction:
    """What the no-split-brain rule says a run on fake hosts must end with."""

    #: True: the head's side goes on to the last step; False: it stops for want of quorum.
    proceeds: bool
    #: The replicas of the last world, one set per way the run may go (a flap may heal unnoticed).
    final: tuple[frozenset[int], ...]
    #: proceeds=False: the ranks that must leave with the "no quorum" marker (the head's side at the stop).
    stopped: frozenset[int] = frozenset()
    #: Why a draw was refused (None: a valid draw).
    refused: str | None = None
    #: The run has a flap: Open MPI's detector (each rank watches one other, in a ring) declares
    #: dead only those whose watcher sits across the cut while the link is down, and Open MPI
    #: aborts a declared rank once it hears of it. So any non-empty part of ``final[0]`` may
    #: form the last world, or the head's side may stop for want of quorum; one world at most.
    flap: bool = False
    #: The host is lost with Open MPI's daemon (``host_kill``): Open MPI 5.0.x aborts the whole job and
    #: the supervisor's relaunch on the other hosts goes on -- unless the survivors finish in place
    #: first (the abort comes a moment after the loss); then ``proceeds``/``final`` say how, by the
    #: rule, as for a host whose ranks all died out of the survivors' sight.
    host_lost: bool = False
    #: A run with hot re-join on (``--hosts N --joins``): the lost replicas may be back, so the last world
    #: is held to contain ``final[0]`` (the head host's replicas, never hit), and to lie within the job's replicas.
    rejoin: bool = False


def predict(run: ChaosRun, flap_lost: bool = True) -> Prediction:
    """Replay ``run``'s faults through :func:`lightning_recover.comm.quorum.decide` with the inputs the
    survivors have (who was in the previous world, who is still reachable, on which host).

    The faults must fall in distinct steps (each is its own repair). ``flap_lost``: the flap
    lasted long enough for the detector (else it costs nothing)."""
    from lightning_recover.comm import quorum

    world = range(run.world)
    host_of = {r: str(run.host_of(r)) for r in world}
    replica_of = {r: r // run.shards for r in world}
    alive = set(range(run.replicas))
    events = sorted(run.faults, key=lambda f: (f["step"], PHASES.index(f["phase"])))
    for f in events:
        live = [r for r in world if replica_of[r] in alive]
        if replica_of[f["rank"]] not in alive:
            return Prediction(False, (), refused=f"rank {f['rank']} is gone before its fault fires")
        leader = replica_of[min(live)]
        if f["kind"].startswith("host_"):
            if f["kind"] == "host_flap" and not flap_lost:
                continue
            cut = [r for r in live if host_of[r] == host_of[f["rank"]]]
        else:
            cut = [f["rank"]]
        present = [r for r in live if r not in cut]
        keep = {replica_of[r] for r in present} - {replica_of[r] for r in cut}
        if not keep:
            return Prediction(False, (), refused=f"the {f['kind']} at step {f['step']} leaves no replica on the head's side")
        verdict = quorum.decide(alive, keep, quorum.certain_losses(cut, present, host_of, replica_of), leader)
        # The victims' replica-mates leave through the gate, before or after the survivors shrink: a
        # race. Where the verdict depends on it (a mate the only witness on its host), no outcome is certain.
        mates = [r for r in present if replica_of[r] not in keep]
        gone = [r for r in present if r not in mates]
        if mates and quorum.decide(alive, keep, quorum.certain_losses(cut + mates, gone, host_of, replica_of), leader).proceed != verdict.proceed:
            return Prediction(False, (), refused=f"the verdict at step {f['step']} depends on whether replica-mates leave before the repair")
        if f["kind"] in ("host_partition", "host_flap"):
            far = {replica_of[r] for r in cut}
            other = quorum.decide(alive, far, quorum.certain_losses(present, cut, host_of, replica_of), leader)
            if other.proceed:
                return Prediction(False, (), refused=f"the rule lets the cut-off side go on ({other.reason})")
        lost_host = f["kind"] == "host_kill"
        if verdict.proceed:
            alive = keep
            if lost_host:
                return Prediction(True, (frozenset(alive),), host_lost=True)
            continue
        # The head's side stops; the supervisor relaunches (an mpiexec left waiting on ranks it cannot
        # reach -- a frozen or cut-off host, a stopped rank -- is ended by its stall watchdog).
        return Prediction(False, (frozenset(alive),), stopped=frozenset(present), host_lost=lost_host)
    return Prediction(True, (frozenset(alive),))


def _first_microbatch_and_bucket(faults: list[dict[str, Any]]) -> None:
    """Runs on fake hosts fault the first microbatch or bucket: every replica computes one in every step."""
    for f in faults:
        if f["phase"] in ("forward", "backward"):
            f["microbatch"] = 0
        elif f["phase"] == "reduce":
            f["bucket"] = 0


#: The kinds a run's second host fault is drawn from: neither a flap (its cost is unknown in advance) nor a
#: host lost with its daemon (Open MPI aborts the job; the relaunch runs without faults).
SECOND_HOST_FAULT_KINDS = ("host_ranks_kill", "host_freeze", "host_partition")


def draw_host_run(
    index: int, rng: random.Random, steps: int, n_hosts: int, hangs: bool = True, two_host_faults: float = 0.0,
) -> tuple[ChaosRun, Prediction]:
    """One run on fake hosts: one host fault on a host other than the head, and in most runs a rank
    fault on another host, in another step. With ``two_host_faults`` (a probability), a run on 3 or
    more hosts whose first host fault leaves the job in place gets a second one on another host
    (:data:`SECOND_HOST_FAULT_KINDS`) in a later step; drawn after the rest, so a seed's other draws
    stay the same. Draws the rule would end in a way the campaign cannot judge are drawn again
    (benchmarks/chaos.py's docstring: draws left out on purpose); returns the run and its prediction."""
    if n_hosts < 2:
        raise ValueError(f"--hosts must be >= 2 (a host fault needs a host besides the head), got {n_hosts}")
    if steps < 3:
        raise ValueError(f"runs on fake hosts need --steps >= 3 (a step before the host fault and one after), got {steps}")
    topologies = [t for t in HOST_TOPOLOGIES if t[0] <= n_hosts]
    for _ in range(1000):
        H, slots, W, S = rng.choice(topologies)
        run = ChaosRun(index, W, S, None, grad_accum=rng.randint(1, 2), steps=steps, seed=rng.randint(0, 2**31 - 1), hosts=H, slots=slots)
        victim = rng.randrange(1, H)
        kind = rng.choice(HOST_FAULT_KINDS)
        host_step = rng.randint(1, steps - 2)
        fault: dict[str, Any] = {"step": host_step, "rank": rng.choice([r for r in range(run.world) if run.host_of(r) == victim]),
                                 "phase": rng.choice(PHASES), "kind": kind}
        if kind == "host_flap":
            fault["seconds"] = round(rng.uniform(2.0, 6.0), 1)
        run.faults.append(fault)
        elsewhere = [r for r in range(run.world) if run.host_of(r) != victim]
        # Never in the last step (a death after the last commit is in no ledger line); before a
        # flap only, whose cost is not known in advance (Prediction.flap), and before a host lost whole,
        # after which the job is relaunched without faults.
        rank_steps = [t for t in range(steps - 1) if t != host_step and (kind not in ("host_flap", "host_kill") or t < host_step)]
        if rng.random() < 0.7 and rank_steps:
            rank_step = rng.choice(rank_steps)
            r = rng.random()
            # A stopped rank alone on its host has no watchdog beside it and is left to Open MPI's
            # detector, with which the survivors often never began a repair (benchmarks/chaos.py's docstring): a
            # hang goes only where another rank of the host watches it.
            run.faults.append({"step": rank_step, "rank": rng.choice(elsewhere), "phase": rng.choice(PHASES),
                               "kind": "hang" if hangs and r < 0.2 and slots >= 2 else "kill"})
        if two_host_faults and H >= 3 and kind in SECOND_HOST_FAULT_KINDS and host_step < steps - 2 and rng.random() < two_host_faults:
            second = rng.choice([h for h in range(1, H) if h != victim])
            run.faults.append({"step": rng.randint(host_step + 1, steps - 2),
                               "rank": rng.choice([r for r in range(run.world) if run.host_of(r) == second]),
                               "phase": rng.choice(PHASES), "kind": rng.choice(SECOND_HOST_FAULT_KINDS)})
        if len({f["step"] for f in run.faults}) < len(run.faults):
            continue  # each fault its own repair (predict)
        _first_microbatch_and_bucket(run.faults)
        pred = predict(run)
        if pred.refused is not None:
            continue
        if sum(f["kind"].startswith("host_") for f in run.faults) == 2 and not pred.proceeds:
            continue  # the job would stop before (or at) the second host fault: draw one whose both faults land in place
        if kind == "host_flap":
            # Which replicas a flap costs is up to the detector's ring (Prediction.flap): the
            # replicas alive before it are all the campaign can hold the last world to.
            quiet = predict(run, flap_lost=False)
            if quiet.refused is not None or not quiet.proceeds:
                continue
            pred = Prediction(True, quiet.final, flap=True)
        return run, pred
    raise RuntimeError(f"no valid run on {n_hosts} hosts drawn in 1000 tries; this is a bug in draw_host_run")


#: (hosts, slots per host, replicas, shards) for ``--hosts N --joins``: the job fills hosts 0 and 1, host 2
#: is the spare host the launcher names for re-join (:mod:`lightning_recover.membership.placement`).
HOST_JOIN_TOPOLOGIES: tuple[tuple[int, int, int, int], ...] = ((3, 1, 2, 1), (3, 2, 4, 1), (3, 2, 2, 2))
#: The host that holds no rank of a ``--joins`` run on fake hosts: where its replacements go.
SPARE_HOST = 2
#: The draw kinds of ``--hosts N --joins`` (issue 36), counted by the summary: a host fault on the
#: replacement's host while it is started, seated or fed the state, a frozen host during the transfer,
#: the spare host lost later in the run, two host faults in one run, a rank stopped alone on its host.
JOIN_DRAW_KINDS = ("host fault during a join", "frozen host during a transfer", "spare host lost", "two host faults",
                   "rank stopped alone on its host")
#: Host faults a replacement's host may get while it joins (a host lost with Open MPI's daemon aborts the job).
JOIN_HOST_KINDS = ("host_ranks_kill", "host_freeze", "host_partition", "host_kill")


def join_draw_kinds(run: ChaosRun, fired: list[dict[str, Any]] | None = None) -> list[str]:
    """Which of :data:`JOIN_DRAW_KINDS` ``run``'s schedule has, or (``fired``) those of its faults that fired."""
    if fired is not None:
        run = replace(run, faults=fired)
    kinds = []
    joins = [f for f in run.faults if f["phase"] in JOIN_PHASES]
    if any(f["kind"].startswith("host_") for f in joins):
        kinds.append(JOIN_DRAW_KINDS[0])
    if any(f["kind"] == "host_freeze" and f["phase"] == "join_transfer" for f in joins):
        kinds.append(JOIN_DRAW_KINDS[1])
    training = [f for f in run.faults if f["phase"] not in JOIN_PHASES]
    # A host fault triggered by a rank that was lost earlier: its replacement's host, the spare host.
    if any(g["kind"].startswith("host_") and g["rank"] == f["rank"] and g["step"] > f["step"] for f in training for g in training):
        kinds.append(JOIN_DRAW_KINDS[2])
    if sum(f["kind"].startswith("host_") for f in run.faults) >= 2:
        kinds.append(JOIN_DRAW_KINDS[3])
    if any(f["kind"] == "hang" and sum(run.host_of(r) == run.host_of(f["rank"]) for r in range(run.world)) == 1
           for f in training):
        kinds.append(JOIN_DRAW_KINDS[4])
    return kinds


def draw_host_join_run(index: int, rng: random.Random, steps: int, n_hosts: int, standbys: int = 0) -> tuple[ChaosRun, Prediction]:
    """One run on fake hosts with hot re-join on: the job on hosts 0 (the head) and 1, host
    :data:`SPARE_HOST` spare. Early on, host 1 loses its replicas (all its ranks killed, frozen,
    cut off, or lost with Open MPI's daemon) or, on one-slot hosts, its lone rank is SIGSTOPped
    (nobody on its host watches it). Their replacements go to the spare host; about half of the
    runs fault the first attempt while it starts, is fed the state or has just joined (a kill of
    the replacement, or a host fault of the spare host), and about 40% lose the spare host again
    late in the run (what runs there then: a replacement or a standby). The head's side holds
    at least half of every world, so the rule always lets it go on in place, except where a
    host is lost with its daemon (Open MPI aborts the job; the supervisor relaunches)."""
    if n_hosts < 3:
        raise ValueError(f"--hosts N --joins needs N >= 3 (the job on two hosts and a spare host for replacements), got {n_hosts}")
    if steps < 20:
        raise ValueError(f"--hosts N --joins needs --steps >= 20 (replacements take seconds to start on 2 cores), got {steps}")
    H, slots, W, S = rng.choice(HOST_JOIN_TOPOLOGIES)
    run = ChaosRun(index, W, S, None, grad_accum=rng.randint(1, 2), steps=steps, seed=rng.randint(0, 2**31 - 1),
                   rejoin=True, standbys=standbys, hosts=H, slots=slots)
    on_host1 = [r for r in range(run.world) if run.host_of(r) == 1]
    first_kinds = [*JOIN_HOST_KINDS, *(["hang", "hang"] if slots == 1 else [])]
    kind = rng.choice(first_kinds)
    if kind == "host_kill" and rng.random() < 0.5:
        kind = rng.choice(first_kinds)  # a lost daemon ends the run's faults (the relaunch runs none): drawn less
    first_step = rng.randint(1, 3)
    lost_rank = rng.choice(on_host1)
    run.faults.append({"step": first_step, "rank": lost_rank, "phase": rng.choice(PHASES), "kind": kind})
    if kind != "host_kill" and rng.random() < 0.5:
        # The first re-join attempt: its replacement of ``lost_rank`` (on the spare host) killed, or its host hit.
        phase = rng.choice(JOIN_PHASES)
        jkind = rng.choice(["kill", *JOIN_HOST_KINDS, "host_freeze"] if phase == "join_transfer" else ["kill", *JOIN_HOST_KINDS])
        run.faults.append({"step": 1, "rank": lost_rank, "phase": phase, "kind": jkind})
    if kind != "host_kill" and not any(f["kind"] == "host_kill" for f in run.faults) and rng.random() < 0.4:
        # Late, the spare host is lost again; its trigger is the replacement of ``lost_rank``, running there
        # by then (a run whose re-join never succeeded has nobody there to trigger it: not fired).
        run.faults.append({"step": rng.randint(steps - 8, steps - 3), "rank": lost_rank, "phase": rng.choice(PHASES),
                           "kind": rng.choice(SECOND_HOST_FAULT_KINDS)})
    _first_microbatch_and_bucket(run.faults)
    head = frozenset(r // S for r in range(run.world) if run.host_of(r) == 0)
    lost = any(f["kind"] == "host_kill" for f in run.faults)
    return run, Prediction(True, (head,), host_lost=lost, rejoin=True)


#: ``--hosts N --salvage``: 2 replicas x 2 shards on hosts 0 and 1 (two slots each), host :data:`SPARE_HOST` spare.
HOST_SALVAGE_TOPOLOGY = (3, 2, 2, 2)
#: Later host faults of a ``--hosts N --salvage`` run: on the spare host (the rank the orphan spawned there)
#: or on host 1 (the seated orphan), each taking the re-formed replica that spans the two hosts.
SALVAGE_HOST_KINDS = ("host_ranks_kill", "host_freeze", "host_partition")


def draw_host_salvage_run(index: int, rng: random.Random, steps: int, n_hosts: int) -> tuple[ChaosRun, Prediction]:
    """One run on fake hosts with salvage and re-join on: 2 replicas x 2 shards, replica 0 on host 0 (the head),
    replica 1 on host 1, host :data:`SPARE_HOST` spare. Early on one rank of host 1 is SIGKILLed: its
    mate waits as an orphan on host 1 and spawns the missing rank, which re-join places on the spare
    host, so the re-formed replica spans hosts 1 and 2. In about half of the runs a host fault later
    hits that replica on one of its two hosts (:data:`SALVAGE_HOST_KINDS`), triggered by its rank
    there. The head's replica is never hit, so the rule always lets it go on in place."""
    if n_hosts < 3:
        raise ValueError(f"--hosts N --salvage needs N >= 3 (the job on two hosts and a spare host), got {n_hosts}")
    if steps < 20:
        raise ValueError(f"--hosts N --salvage needs --steps >= 20 (a seated orphan runs the script's set-up again), got {steps}")
    H, slots, W, S = HOST_SALVAGE_TOPOLOGY
    run = ChaosRun(index, W, S, None, grad_accum=rng.randint(1, 2), steps=steps, seed=rng.randint(0, 2**31 - 1),
                   rejoin=True, salvage=True, hosts=H, slots=slots)
    on_host1 = [r for r in range(run.world) if run.host_of(r) == 1]
    lost = rng.choice(on_host1)
    orphan = next(r for r in on_host1 if r != lost)
    run.faults.append({"step": rng.randint(1, 3), "rank": lost, "phase": rng.choice(PHASES), "kind": "kill"})
    if rng.random() < 0.5:
        # The spawned replacement of ``lost`` runs on the spare host, the seated orphan on host 1.
        trigger = rng.choice([lost, orphan])
        run.faults.append({"step": rng.randint(steps - 8, steps - 3), "rank": trigger, "phase": rng.choice(PHASES),
                           "kind": rng.choice(SALVAGE_HOST_KINDS)})
    _first_microbatch_and_bucket(run.faults)
    head = frozenset(r // S for r in range(run.world) if run.host_of(r) == 0)
    return run, Prediction(True, (head,), rejoin=True)


# ---------------------------------------------------------------------- judging
@dataclass
class Outcome:
    """One run's verdict: what fired and was recovered, every violation, and what a run on fake hosts showed."""

    run: ChaosRun
    seconds: float
    hang: bool = False
    fired: int = 0
    recovered: int = 0
    violations: list[str] = field(default_factory=list)
    pauses: list[float] = field(default_factory=list)
    #: Per step that lost a hung or stuck replica: the longest failed round, i.e. how long the
    #: survivors were blocked before the watchdog's kill freed them.
    detects: list[float] = field(default_factory=list)
    #: Corruption checks run and detections, summed over the ranks that finished.
    sdc_checks: int = 0
    sdc_detections: int = 0
    #: Injected corruptions that fired, and how many of them the ledger shows detected.
    corruptions: int = 0
    corruptions_found: int = 0
    #: ``--salvage``: which of :data:`SALVAGE_EVENTS` the run's log shows.
    salvage_events: list[str] = field(default_factory=list)
    #: Runs on fake hosts: two sides trained (each entry says how it showed).
    split_brain: list[str] = field(default_factory=list)
    #: The host faults the harness applied ("KIND HOST ranks [...]").
    host_faults: list[str] = field(default_factory=list)
    #: The first attempt stopped for want of quorum, as the rule said it must.
    no_quorum: bool = False
    #: Ranks of a cut-off host that left with the no-quorum marker.
    cut_off_left: int = 0
    #: Runs on fake hosts (supervised): how often the supervisor relaunched the job, and what each relaunch cost.
    relaunches: int = 0
    #: Relaunches that found every step committed: an attempt's ranks finished as mpiexec's abort came.
    idle_relaunches: int = 0
    relaunch_costs: list[str] = field(default_factory=list)
    #: The in-place repair was cut short by its bound (an agreement Open MPI never returned from).
    bounded: bool = False
    #: Why the first attempt could not go on in place ("" when it did).
    relaunch_cause: str = ""
    #: ``--hosts N --joins``: relaunched by the stall timeout after a replacement was frozen or cut off
    #: with its host (no failure detector watches a spawned process: benchmarks/chaos.py's docstring).
    unwatched: bool = False
    #: ``--hosts N --joins``: the :data:`JOIN_DRAW_KINDS` whose faults fired in this run.
    join_kinds: list[str] = field(default_factory=list)


def status_markers(directory: Path) -> dict[str, dict[int, str]]:
    """``ok`` / ``exited`` / ``raised`` / ``started`` markers the ranks of one attempt left in its status directory: kind -> rank -> text."""
    out: dict[str, dict[int, str]] = {"ok": {}, "exited": {}, "raised": {}, "started": {}}
    for marker in directory.glob("*.*"):
        what, _, rank = marker.name.partition(".")
        if what in out and rank.isdigit():
            out[what][int(rank)] = marker.read_text(errors="replace")
    return out


@dataclass
class Attempt:
    """What one attempt of a supervised run left: its ranks' markers, results and ledger."""

    index: int
    markers: dict[str, dict[int, str]]
    results: dict[int, dict[str, Any]]
    ledger_path: Path


def read_attempts(outdir: Path) -> list[Attempt]:
    """The attempts of a supervised run, in order (the supervisor keeps ``status/supervise-*/attempt-K``)."""
    dirs = sorted(outdir.glob("status/supervise-*/attempt-*"), key=lambda d: int(d.name.rpartition("-")[2]))
    found = []
    for i, d in enumerate(dirs):
        final = i == len(dirs) - 1
        results = {int(f.name[4:].partition(".")[0]): json.loads(f.read_text()) for f in outdir.glob(f"rank*.attempt-{i}.json")}
        found.append(Attempt(i, status_markers(d), results, outdir / ("ledger.jsonl" if final else f"ledger.attempt-{i}.jsonl")))
    return found


def last_relaunch_idle(ledger_lengths: list[int], steps: int) -> bool:
    """Whether the last attempt of a supervised run was a relaunch that found every step committed.

    ``ledger_lengths``: the lines of each attempt's ledger as it left it (the last one's is
    the live file, an earlier one's the copy the supervisor kept). Such a relaunch trained
    nothing -- mpiexec's abort lost the race with the survivors' last step -- so its ranks
    restored the final checkpoint and are not held to the last world, which an earlier
    attempt formed."""
    return len(ledger_lengths) > 1 and ledger_lengths[-1] == ledger_lengths[-2] == steps


def supervisor_lines(log_text: str) -> list[str]:
    """The supervisor's own lines in a launcher log (each relaunch's reason and cost)."""
    return [line for line in log_text.splitlines() if "[lightning-recover] supervise:" in line]


def summary(outcomes: list[Outcome]) -> str:
    """The campaign's closing table, one ``name  value`` row each (the tests read it back by those names)."""
    faults = sum(len(o.run.faults) for o in outcomes)
    fired = sum(o.fired for o in outcomes)
    recovered = sum(o.recovered for o in outcomes)
    violations = sum(1 for o in outcomes if o.violations and not o.hang)
    hangs = sum(1 for o in outcomes if o.hang)
    on_hosts = any(o.run.hosts for o in outcomes)
    pauses = sorted(p for o in outcomes for p in o.pauses)
    med = pauses[len(pauses) // 2] if pauses else float("nan")
    detects = sorted(d for o in outcomes for d in o.detects)
    rows = [
        ("runs", len(outcomes)), ("faults scheduled", faults), ("faults injected (fired)", fired),
        ("recovered", recovered), ("violations", violations), ("hangs", hangs),
        ("median recovery pause", f"{med:.3f}s"),
        ("corruption checks (all ranks)", sum(o.sdc_checks for o in outcomes)),
        ("corruptions injected / detected", f"{sum(o.corruptions for o in outcomes)} / {sum(o.corruptions_found for o in outcomes)}"),
        ("sdc false positives", sum(1 for o in outcomes if any(v.startswith("false positive") for v in o.violations))),
    ]
    if on_hosts:
        rows += [
            ("split brains", sum(1 for o in outcomes if o.split_brain)),
            ("host faults applied", sum(len(o.host_faults) for o in outcomes)),
            ("host faults by kind", ", ".join(f"{k} {n}" for k, n in sorted(Counter(h.split()[0].rstrip(":") for o in outcomes for h in o.host_faults).items())) or "-"),
            ("runs with two host faults", sum(1 for o in outcomes if len(o.host_faults) >= 2)),
            ("no-quorum stops (the rule's outcome)", sum(1 for o in outcomes if o.no_quorum)),
            ("relaunched by the supervisor", f"{sum(1 for o in outcomes if o.relaunches)}"
             + "".join(f"; {cause}: {n}" for cause, n in sorted(Counter(o.relaunch_cause for o in outcomes if o.relaunches).items()))),
            ("cut-off ranks that left (no quorum)", sum(o.cut_off_left for o in outcomes)),
            ("relaunches that found the job finished", sum(o.idle_relaunches for o in outcomes)),
        ]
    if any(o.run.salvage for o in outcomes):
        rows += [(f"salvage: {event}", sum(1 for o in outcomes if event in o.salvage_events)) for event in SALVAGE_EVENTS]
    if any(o.run.hosts and o.run.rejoin for o in outcomes):
        rows += [(f"fired: {kind}", sum(1 for o in outcomes if kind in o.join_kinds)) for kind in JOIN_DRAW_KINDS]
    if detects:
        rows.append(("silent-fault detection", f"n={len(detects)} median {detects[len(detects) // 2]:.2f}s max {detects[-1]:.2f}s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
