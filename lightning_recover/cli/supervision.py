"""Supervised relaunch: the decision layer of the recovery protocol's last resort.

lightning-recover repairs a failure *in place* whenever the MPI lets the survivors go on
(ULFM revoke, shrink, agree; the versatile workload keeps B). Some failures end the whole
job instead, and no code inside the job can prevent it:

* **a lost daemon** -- Open MPI 5.0.x's runtime (PRRTE 3.0) aborts every rank when it
  loses a remote daemon (a host rebooted or lost power), printing "PRTE has lost
  communication with a remote daemon", and mpiexec still reports status 0;
* **every replica died** (killed by signals, or lost with their nodes);
* **a hang** no rank detects (an agreement that never returns, a partition without
  Open MPI's detector): the job's progress simply stops;
* **a stop below min_replicas** (the strategy ends the job with status 3, by policy);
* **no quorum** -- half the replicas, the leader's among them, lost to a cause the
  survivors cannot verify (a lost or cut-off host): the quorum rule
  (:mod:`lightning_recover.comm.quorum`) stops the other half too (each rank by SIGUSR2; the job reports status 75), so that two
  worlds never train at once.

``lightning-recover launch --supervise`` (:func:`lightning_recover.cli.launcher.supervise`)
runs the job, and when it ends this way relaunches the same command from the newest
checkpoint on the hosts that remain. This module is the pure half of that loop: from the
hosts, the policy and what one ``mpiexec`` run left behind (the ranks' status markers,
the tail of its output, whether the stall watchdog ended it) it decides *done*,
*relaunch on these hosts with this many ranks after this backoff*, or *give up, and why*.
It imports neither MPI nor torch, runs nothing and sleeps nowhere, so every rule is a
property test (tests/inprocess/test_supervision.py).

Decision rules (:func:`decide`), in this order:

1. A rank wrote ``ok``: the program ended normally on the survivors -> **done**.
   Completion is judged by what the ranks wrote, never by mpiexec's status (0 on abort).
2. The relaunch budget is spent -> **give up** (name ``--max-relaunches``).
3. The cause is the program, not the machines -> **give up**: a rank raised an uncaught
   exception (the same bug would fire again), a deliberate stop other than the
   too-few-replicas status, or a command that failed before any rank came up.
   A lost daemon named by PRRTE takes precedence over exceptions: ranks of an aborting
   job may raise on the way down.
4. Otherwise (lost daemon, every replica died, the stall watchdog fired, a stop below
   min_replicas, a stop for want of quorum, Open MPI's runtime failed to start) -> **relaunch** on the hosts that
   remain: the previous hosts minus every host PRRTE named as lost (in its lost-daemon
   message, or as the host whose daemon never reported back at start-up) and every host
   the launcher's probe could not reach. A lost host never comes back within one supervision.

How many ranks a relaunch gets (:func:`relaunch_plan`): B (= T * G_init) and the sample
order come from the checkpoint, and a resume on fewer replicas keeps B by giving each
replica more microbatches (the static policy counts the missing replicas as lost), so
the trajectory -- and the ledger -- is the fault-free one whatever the replica count. The
relaunch therefore takes as many *whole replicas* as the remaining slots hold, never more
ranks than the original job (extra replicas would only be spares): ``n' = min(n,
S * floor(slots / S))`` for replica size S (``recover.shards``), or ``n' = n`` with
oversubscription allowed. Fewer than ``min_replicas`` replicas -> **give up**, naming the
fixes (more hosts, ``--oversubscribe``, a lower ``--min-replicas``).

Backoff: relaunch k (1-based) waits ``min(backoff_s * 2**(k-1), max_backoff_s)``: a host
that is rebooting or a runtime that failed to start gets a moment, and a job that keeps
failing spends a bounded total time (``max_relaunches`` attempts) before the verdict.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lightning_recover.runtime.slurm import parse_slurm_counts

#: What PRRTE 3.0 prints when it loses a remote daemon (help-errmgr-base.txt, [node-died]).
LOST_DAEMON = "PRTE has lost communication with a remote daemon"
#: The line of that message that names the lost daemon's node: ``Remote daemon: [prterun-x-1@0,2] on node nodeB``.
_REMOTE_NODE = re.compile(r"Remote daemon\s*:\s*\S+\s+on node\s+(\S+)")
#: PRRTE could not start a daemon on some host: help-errmgr-base.txt's [failed-daemon-launch] and
#: [failed-daemon], and prterun's own report, which names the host (``Remote host:   nodeB``; seen
#: here with an unresolvable host name).
DAEMON_REPORT_FAILURE = "A daemon failed to report back after being spawned"
DAEMON_START_FAILURES = (
    "was unable to reliably start one or more daemons", "PRTE daemon has unexpectedly failed after launch", DAEMON_REPORT_FAILURE,
)
_REMOTE_HOST = re.compile(r"Remote host:\s+(\S+)")
#: Open MPI 5's PMIx listener race (see lightning_recover.cli.runner.RUNTIME_START_FAILURE): no rank ran.
RUNTIME_START_FAILURE = "The PMIx server's listener thread failed to start"
#: The status a job ends with when fewer than ``min_replicas`` replicas are alive (the strategy's
#: policy stop, ``end_job(comm, 3)``; examples/pretrain.py exits with it): a relaunch restores replicas.
TOO_FEW_REPLICAS_STATUS = 3

Cause = Literal[
    "completed",  # a rank wrote ok
    "lost_daemon",  # PRRTE aborted the job after losing a remote daemon
    "stalled",  # the supervisor's stall watchdog ended the job: no progress for the stall timeout
    "died",  # ranks came up, none ended on purpose, none raised: every replica died
    "too_few_replicas",  # the job stopped itself below min_replicas (status 3)
    "no_quorum",  # ranks stopped because their side of a failure lost the quorum (SIGUSR2)
    "runtime_start_failed",  # Open MPI's runtime (or a daemon) did not come up: no rank ran
    "lost_at_start",  # a rank was lost before its communicator came up (lightning_recover.cli.startup)
    "raised",  # the program raised an uncaught exception and no rank finished
    "stopped",  # the program stopped on purpose with another status (e.g. 2, a configuration error)
    "not_started",  # no rank came up and the runtime did not say why: the command itself failed
]
#: Causes that a relaunch can cure (the machines failed, or the job stopped by policy).
RELAUNCHABLE: frozenset[Cause] = frozenset(
    {"lost_daemon", "stalled", "died", "too_few_replicas", "no_quorum", "runtime_start_failed", "lost_at_start"}
)


@dataclass(frozen=True)
class Host:
    """One host of the job and the ranks it may run (Open MPI's slots)."""

    name: str
    slots: int

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() or c in ",:" for c in self.name):
            raise ValueError(f"host name {self.name!r} is not a host name; write hosts as 'node1:2,node2:2'")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"host {self.name!r} has slots={self.slots!r}; give it a positive number of slots ('{self.name}:2')")

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def _unique(hosts: list[Host], source: str) -> tuple[Host, ...]:
    if not hosts:
        raise ValueError(f"{source} names no host; give at least one ('node1:2')")
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise ValueError(f"{source} names host {h.name!r} twice; give each host once with its total slots")
        seen.add(h.name)
    return tuple(hosts)


def parse_host_list(spec: str) -> tuple[Host, ...]:
    """``"node1:2,node2:2"`` (mpiexec's ``--host`` syntax; a host without ``:N`` has 1 slot, as in Open MPI)."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"--hosts {spec!r} has an empty entry; write 'node1:2,node2:2'")
        name, colon, slots = item.partition(":")
        if colon and not slots.isdigit():
            raise ValueError(f"--hosts entry {item!r}: slots {slots!r} is not a number; write '{name}:2'")
        hosts.append(Host(name, int(slots) if colon else 1))
    return _unique(hosts, f"--hosts {spec!r}")


def parse_hostfile(text: str, source: str = "the hostfile") -> tuple[Host, ...]:
    """An Open MPI hostfile: ``name [slots=N] [max_slots=M]`` per line, ``#`` comments (no slots: 1)."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        slots = 1
        for opt in options:
            key, eq, value = opt.partition("=")
            if key in ("slots", "slot") and eq and value.isdigit():
                slots = int(value)
            elif key not in ("max_slots", "max-slots") or not value.isdigit():
                raise ValueError(f"{source}:{lineno}: {opt!r} is not 'slots=N' or 'max_slots=N'; write '{name} slots=2'")
        hosts.append(Host(name, slots))
    return _unique(hosts, source)


def slurm_hosts(names: Sequence[str], per_node: str) -> tuple[Host, ...]:
    """The allocation's hosts (``scontrol show hostnames``) with their slots from Slurm's per-node counts."""
    return _unique([Host(n, c) for n, c in zip(names, parse_slurm_counts(per_node, len(names)))], "the Slurm allocation")


def host_arg(hosts: Sequence[Host]) -> str:
    """mpiexec's ``--host`` value."""
    return ",".join(str(h) for h in hosts)


def free_hosts(hosts: Sequence[Host], nprocs: int) -> tuple[Host, ...]:
    """The hosts with slots left once ``nprocs`` ranks fill ``hosts`` in order (Open MPI's default
    mapping), each with its free slots: spare hosts (no rank of the job) first, then hosts
    partly used, each group in host order. Where re-join places replacements
    (:mod:`lightning_recover.membership.placement`)."""
    if nprocs < 0:
        raise ValueError(f"nprocs must be >= 0, got {nprocs}")
    left, spare, partial = nprocs, [], []
    for h in hosts:
        used = min(left, h.slots)
        left -= used
        if used == 0:
            spare.append(h)
        elif used < h.slots:
            partial.append(Host(h.name, h.slots - used))
    return (*spare, *partial)


def _short(name: str) -> str:
    return name.split(".", 1)[0]


def hosts_named_lost(output: str, hosts: Sequence[Host]) -> frozenset[str]:
    """The hosts of ``hosts`` that PRRTE names in its lost-daemon message, or in its report of a daemon
    that never came up (matching a short name to an FQDN too)."""
    named = {m.group(1).strip(".,;") for m in _REMOTE_NODE.finditer(output)} if LOST_DAEMON in output else set()
    if DAEMON_REPORT_FAILURE in output:
        named |= {m.group(1).strip(".,;") for m in _REMOTE_HOST.finditer(output.split(DAEMON_REPORT_FAILURE, 1)[1])}
    return frozenset(h.name for h in hosts if h.name in named or _short(h.name) in {_short(n) for n in named})


@dataclass(frozen=True)
class Outcome:
    """What one ``mpiexec`` run left: its status, its output's tail, the ranks' markers, the watchdog's verdict.

    ``started``/``ok``/``exited``/``raised`` are the ranks that left those status markers
    (:data:`lightning_recover.runtime.markers.ENV_STATUS_DIR`); ``raised`` maps a rank to its
    exception's summary line.
    """

    nprocs: int
    status: int
    output_tail: str = ""
    started: frozenset[int] = frozenset()
    ok: frozenset[int] = frozenset()
    exited: frozenset[int] = frozenset()
    no_quorum: frozenset[int] = frozenset()  # of ``exited``: stopped by the quorum rule
    raised: Mapping[int, str] = field(default_factory=dict)
    stalled: bool = False
    #: a rank was lost before its communicator came up (the start watch's status, or the survivors' markers)
    lost_at_start: bool = False


def classify(outcome: Outcome) -> Cause:
    """Why the run ended (see the module docstring for the precedence)."""
    if outcome.ok:
        return "completed"
    if LOST_DAEMON in outcome.output_tail:
        return "lost_daemon"
    if outcome.stalled:
        return "stalled"
    if outcome.lost_at_start:
        return "lost_at_start"
    if outcome.no_quorum:
        # Before "raised": a rank of the stopping side may raise on its way out.
        return "no_quorum"
    if outcome.raised:
        return "raised"
    if outcome.exited:
        return "too_few_replicas" if outcome.status == TOO_FEW_REPLICAS_STATUS else "stopped"
    if outcome.started:
        return "died"
    if RUNTIME_START_FAILURE in outcome.output_tail or any(s in outcome.output_tail for s in DAEMON_START_FAILURES):
        return "runtime_start_failed"
    return "not_started"


@dataclass(frozen=True)
class SupervisionPolicy:
    """The bounds of supervision (``lightning-recover launch --supervise`` options)."""

    max_relaunches: int = 3
    replica_size: int = 1  # ranks per replica (recover.shards): the unit a relaunch adds or drops
    min_replicas: int = 1
    oversubscribe: bool = False  # may a relaunch put more ranks on a host than its slots
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        for name, minimum in (("max_relaunches", 0), ("replica_size", 1), ("min_replicas", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {minimum}, got {value!r}")
        if not 0 <= self.backoff_s <= self.max_backoff_s < float("inf"):
            raise ValueError(
                f"--relaunch-backoff {self.backoff_s!r} must be >= 0 and at most the maximum backoff {self.max_backoff_s!r} seconds"
            )

    def backoff(self, relaunch: int) -> float:
        """Seconds to wait before relaunch number ``relaunch`` (1-based): doubling, capped."""
        return min(self.backoff_s * 2 ** min(max(relaunch - 1, 0), 62), self.max_backoff_s)


@dataclass(frozen=True)
class Plan:
    """Where one attempt runs: these hosts, this many ranks."""

    hosts: tuple[Host, ...]
    nprocs: int

    @property
    def slots(self) -> int:
        return sum(h.slots for h in self.hosts)


def first_plan(policy: SupervisionPolicy, hosts: Sequence[Host], nprocs: int) -> Plan:
    """The first launch: ``nprocs`` ranks on ``hosts``, checked against the policy."""
    if nprocs < 1 or nprocs % policy.replica_size:
        raise ValueError(
            f"-n {nprocs} is not a positive multiple of the replica size {policy.replica_size}; "
            "launch whole replicas (-n = replicas x --replica-size)"
        )
    if nprocs // policy.replica_size < policy.min_replicas:
        raise ValueError(f"-n {nprocs} holds {nprocs // policy.replica_size} replica(s), fewer than --min-replicas {policy.min_replicas}")
    plan = Plan(tuple(hosts), nprocs)
    if not hosts:
        raise ValueError("no hosts to run on; give --hosts or --hostfile")
    if nprocs > plan.slots and not policy.oversubscribe:
        raise ValueError(
            f"-n {nprocs} needs more slots than the hosts have ({host_arg(hosts)}: {plan.slots}); "
            "add hosts or slots, or pass --oversubscribe"
        )
    return plan


def relaunch_plan(policy: SupervisionPolicy, hosts: Sequence[Host], target_nprocs: int) -> Plan | str:
    """Whole replicas on ``hosts``, at most ``target_nprocs`` ranks; or why that is too few (a message naming the fixes)."""
    S = policy.replica_size
    slots = sum(h.slots for h in hosts)
    if not hosts:
        n = 0
    elif policy.oversubscribe:
        n = target_nprocs
    else:
        n = min(target_nprocs, S * (slots // S))
    if n // S < policy.min_replicas:
        have = f"{len(hosts)} host(s) with {slots} slot(s) ({host_arg(hosts)})" if hosts else "no host"
        return (
            f"{have} remain, room for {n // S} replica(s) of {S} rank(s), fewer than --min-replicas {policy.min_replicas}; "
            "add hosts (--hosts/--hostfile, or a larger Slurm allocation), allow --oversubscribe, or lower --min-replicas"
        )
    return Plan(tuple(hosts), n)


@dataclass(frozen=True)
class Decision:
    """The verdict on one run: ``done``, ``relaunch`` (on ``plan`` after ``backoff_s``) or ``give_up`` (``reason`` says why)."""

    action: Literal["done", "relaunch", "give_up"]
    cause: Cause
    reason: str
    plan: Plan | None = None
    lost: frozenset[str] = frozenset()  # hosts dropped by this decision
    backoff_s: float = 0.0


_WHY: dict[Cause, str] = {
    "completed": "the job finished",
    "lost_daemon": "Open MPI's runtime lost a host's daemon and aborted the whole job",
    "stalled": "no progress within the stall timeout (a hang); the supervisor ended the job",
    "died": "every replica died (killed by a signal or lost with its host)",
    "too_few_replicas": f"the job stopped below min_replicas (status {TOO_FEW_REPLICAS_STATUS})",
    "no_quorum": "no side of the failure held a quorum (a lost or cut-off host with half the replicas and the leader)",
    "runtime_start_failed": "Open MPI's runtime did not start on every host",
    "lost_at_start": "a rank was lost while the job started, before its communicator came up",
    "raised": "the program raised an uncaught exception",
    "stopped": "the program stopped on purpose",
    "not_started": "no rank came up: the command failed before MPI started",
}


def decide(
    policy: SupervisionPolicy,
    plan: Plan,
    outcome: Outcome,
    *,
    relaunches_done: int,
    target_nprocs: int,
    unreachable: frozenset[str] = frozenset(),
) -> Decision:
    """The verdict on ``outcome``, the run of ``plan`` after ``relaunches_done`` relaunches.

    ``unreachable``: the hosts the launcher's probe could not reach after the run (it
    probes only when the cause is one a relaunch can cure). ``target_nprocs``: the
    original job's rank count, which a relaunch never exceeds.
    """
    cause = classify(outcome)
    why = _WHY[cause]
    if cause == "completed":
        return Decision("done", cause, why)
    if cause not in RELAUNCHABLE:
        detail = ""
        if cause == "raised":
            detail = ": " + "; ".join(sorted(set(outcome.raised.values())))
            fix = "fix the error, then relaunch from the newest checkpoint"
        elif cause == "stopped":
            fix = f"see its message above (exit status {outcome.status})"
        else:
            fix = f"run the command by hand to see why (mpiexec status {outcome.status})"
        return Decision("give_up", cause, f"{why}{detail}; a relaunch would not help: {fix}")
    lost = (hosts_named_lost(outcome.output_tail, plan.hosts) | unreachable) & {h.name for h in plan.hosts}
    if relaunches_done >= policy.max_relaunches:
        return Decision(
            "give_up", cause,
            f"{why}, and all {policy.max_relaunches} relaunch(es) are spent; raise --max-relaunches or fix what keeps failing",
            lost=frozenset(lost),
        )
    remaining = [h for h in plan.hosts if h.name not in lost]
    next_plan = relaunch_plan(policy, remaining, target_nprocs)
    if isinstance(next_plan, str):
        return Decision("give_up", cause, f"{why}; {next_plan}", lost=frozenset(lost))
    if lost:
        why += f"; lost host(s): {', '.join(sorted(lost))}"
    return Decision("relaunch", cause, why, plan=next_plan, lost=frozenset(lost), backoff_s=policy.backoff(relaunches_done + 1))


# ---------------------------------------------------------------------- what a relaunch cost
_CHECKPOINT_STEP = re.compile(r"step-(\d+)")


def checkpoint_step(name: str) -> int | None:
    """Steps done at a fallback checkpoint, from its file name (``step-00000010.ckpt`` -> 10): the resumed job's first step."""
    m = _CHECKPOINT_STEP.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RelaunchCost:
    """The time one relaunch lost, in its parts (measured by the launcher from file times and the ledger).

    * ``detection_s``: the last committed step of the failed job -> the supervisor saw it
      end (the abort, or the stall timeout; includes the step that was cut short);
    * ``relaunch_s``: -> every rank of the new job had its communicator up (probe, backoff,
      mpiexec start, imports, MPI init);
    * ``restore_s``: -> the new job's first committed step, less that step's own time
      (checkpoint load, model and strategy setup); NaN when the new job committed none;
    * ``replay_s``: the committed steps since the checkpoint that the new job redoes
      (``replayed_steps`` of them), at their original step times.
    """

    detection_s: float
    relaunch_s: float
    restore_s: float
    replayed_steps: int
    replay_s: float

    @property
    def total_s(self) -> float:
        """The parts known (a restore that never finished counts as nothing: the next relaunch's cost holds that time)."""
        restore = self.restore_s if self.restore_s == self.restore_s else 0.0
        return self.detection_s + self.relaunch_s + restore + self.replay_s

    def describe(self) -> str:
        restore = f"{self.restore_s:.1f} s" if self.restore_s == self.restore_s else "- (the relaunched job committed no step)"
        return (
            f"{self.total_s:.1f} s = detection {self.detection_s:.1f} s + relaunch {self.relaunch_s:.1f} s + "
            f"restore {restore} + replay {self.replay_s:.1f} s ({self.replayed_steps} step(s) since the checkpoint)"
        )


def replayed_steps(step_times: Mapping[int, float], resume_step: int | None) -> tuple[int, float]:
    """Committed steps (step -> step time) at or after ``resume_step``: the work a resume from that checkpoint redoes.

    ``None``: no checkpoint, the relaunch starts from step 0 and redoes them all.
    """
    redo = [t for s, t in step_times.items() if s >= (resume_step or 0)]
    return len(redo), float(sum(redo))
