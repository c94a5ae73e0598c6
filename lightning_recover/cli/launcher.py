"""``lightning-recover launch``: run a job under ``mpiexec --with-ft ulfm``, once or supervised.

:func:`launch` runs the job once: it prints the ``mpiexec`` command line
(:mod:`lightning_recover.cli.mpiexec`), runs it so that it always ends
(:mod:`lightning_recover.cli.runner`), and judges the job by the markers its ranks left
(:mod:`lightning_recover.cli.job_status`), not by mpiexec's status.

With ``--supervise`` (:func:`supervise`) it also outlives the job: when a job ends in a
way no rank can repair in place (PRRTE aborted it after losing a host's daemon, every
replica died, its ledger stopped growing, it stopped below min_replicas), the same
command is relaunched from the newest checkpoint (``++ckpt_path=last`` appended) on the
hosts that remain (:mod:`lightning_recover.cli.hosts`), a bounded number of times;
:mod:`lightning_recover.cli.supervision` decides, this module runs, probes and measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from lightning_recover.cli.console import ConsoleFilter, summary
from lightning_recover.cli.hosts import local_host_names, probe_unreachable
from lightning_recover.cli.job_status import JobMarkers, final_words
from lightning_recover.cli.mpiexec import build_command, launch_env, safe_coll_note, spans_hosts
from lightning_recover.cli.startup import StartWatch
from lightning_recover.cli.runner import STALLED_STATUS, START_LOST_STATUS, run_supervised
from lightning_recover.cli.supervision import (
    RELAUNCHABLE,
    Decision,
    Host,
    Outcome,
    RelaunchCost,
    SupervisionPolicy,
    checkpoint_step,
    classify,
    decide,
    first_plan,
    free_hosts,
    host_arg,
    replayed_steps,
)
from lightning_recover.runtime.markers import ENV_SPARE_HOSTS, ENV_STATUS_DIR


def launch(
    nprocs: int,
    command: Sequence[str],
    hang_timeout: float | None = None,
    extra: Sequence[str] = (),
    *,
    hosts: Sequence[Host] | None = None,
    unbound: bool = False,
    status_root: str | None = None,
) -> int:
    """Run the job and return its status; non-zero (1 unless mpiexec's was) if ranks started
    but none of them ended normally. ``hosts`` None: this machine; ``unbound``: see
    :func:`lightning_recover.cli.mpiexec.build_command`.
    ``status_root``: where the ranks leave their status markers, in a new folder that is kept
    (``--status-dir``; on several hosts a folder they all share); default a temporary one here.

    With ULFM, mpiexec reports 0 even when every rank died by a signal (each death is a
    "recoverable" failure); the markers tell a job in which nobody survived, and whether
    its program raised or its replicas died (:func:`lightning_recover.cli.job_status.final_words`).
    """
    import tempfile

    argv = build_command(
        nprocs, command, hang_timeout=hang_timeout, extra=extra, hosts=None if hosts is None else host_arg(hosts),
        slots=None if hosts is None else sum(h.slots for h in hosts), unbound=unbound,
    )
    print("[lightning-recover] " + shlex.join(argv), file=sys.stderr, flush=True)
    if (note := safe_coll_note(argv)) is not None:
        print(f"[lightning-recover] {note}", file=sys.stderr, flush=True)
    env = _with_spare_hosts(launch_env(), hosts, nprocs)
    # Only hosts that are all this machine let the stuck-abort rule see every rank (lightning_recover.cli.runner).
    here = hosts is None or all(h.name in local_host_names() for h in hosts)
    if status_root is not None:
        os.makedirs(status_root, exist_ok=True)
        # Kept: a rank of a cut-off host may leave its marker after the launcher is gone.
        where: Any = contextlib.nullcontext(tempfile.mkdtemp(prefix="job-", dir=status_root))
    else:
        where = tempfile.TemporaryDirectory(prefix="lightning-recover-status-")
    with where as status_dir:
        env[ENV_STATUS_DIR] = status_dir
        with _console(functools.partial(print, file=sys.stderr, flush=True)) as console:
            status = run_supervised(
                argv, env, nprocs=nprocs if here else None, finished=lambda: JobMarkers.read(status_dir).over(nprocs),
                refused=lambda: JobMarkers.read(status_dir).refused, stdout=console.stdout, stderr=console.stderr,
                # Ranks placed elsewhere by a --host passed through --mpi-arg are not in mpiexec's session here.
                start_watch=(start := StartWatch(status_dir, nprocs, all_local=here and not spans_hosts(argv))).poll,
            )
        status, words = final_words(start.local_hosts(JobMarkers.read(status_dir)), nprocs, status)
    if words is not None:
        print(f"[lightning-recover] {words}", file=sys.stderr, flush=True)
    return status


def _with_spare_hosts(env: Mapping[str, str], hosts: Sequence[Host] | None, nprocs: int) -> dict[str, str]:
    """``env`` with the hosts that have free slots after placing ``nprocs`` ranks on ``hosts``
    (:data:`ENV_SPARE_HOSTS`): where re-join puts replacements and warm standbys. Kept when the
    user set it; none on this machine alone (``hosts`` None)."""
    env = dict(env)
    if hosts is None or ENV_SPARE_HOSTS in env:
        return env
    free = free_hosts(hosts, nprocs)
    if free:
        env[ENV_SPARE_HOSTS] = host_arg(free)
    return env


# ---------------------------------------------------------------------- supervised relaunch
#: The attempt a supervised job's ranks belong to (0: the first launch, k: the k-th relaunch).
ENV_ATTEMPT = "LIGHTNING_RECOVER_ATTEMPT"
#: What a relaunch appends to the user's command when a checkpoint exists: Hydra's override that
#: makes examples/pretrain.py (and any script with a ``ckpt_path`` setting) resume from the newest
#: complete checkpoint in recover.checkpoint.dir. ``++`` adds the key or overrides it.
DEFAULT_RESUME_ARG = "++ckpt_path=last"
#: The fallback checkpoint pointer (lightning_recover.callbacks.checkpoint.POINTER; not imported:
#: that module loads Lightning, and the launcher must stay light).
_POINTER = "last.ckpt"
#: How much of mpiexec's output the supervisor keeps to read PRRTE's messages from.
_TAIL_BYTES = 64 * 1024
_OVERRIDE_KEY = re.compile(r"^[+~]*([A-Za-z_][\w.\-/]*)=")


def resume_command(command: Sequence[str], resume_arg: str) -> list[str]:
    """``command`` with ``resume_arg`` appended, replacing the user's own value of the same Hydra key.

    ``resume_arg`` of the form ``[+]KEY=VALUE`` (Hydra's override syntax) first drops any
    ``KEY=...``, ``+KEY=...`` or ``++KEY=...`` already in the command, since Hydra refuses
    a key given twice; any other ``resume_arg`` (``--resume``) is appended as it is.
    """
    m = _OVERRIDE_KEY.match(resume_arg)
    kept = list(command)
    if m is not None:
        key = m.group(1)
        kept = [a for a in command if (k := _OVERRIDE_KEY.match(a)) is None or k.group(1) != key]
    return [*kept, resume_arg]


def newest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The file ``directory/last.ckpt`` names (the newest complete fallback checkpoint), or None."""
    pointer = os.path.join(os.fspath(directory), _POINTER)
    return os.path.realpath(pointer) if os.path.exists(pointer) else None


class _Tee(threading.Thread):
    """Copies one of mpiexec's output pipes to our own stream and keeps its tail (for PRRTE's messages)."""

    def __init__(self, fd: int, sink: object) -> None:
        super().__init__(daemon=True)
        self.fd, self.sink, self.tail = fd, sink, b""
        #: Leaves out Open MPI's internal NBC error lines, and counts them (lightning_recover.cli.console).
        self.filter = ConsoleFilter()

    def run(self) -> None:
        while chunk := os.read(self.fd, 65536):
            self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
            self._show(self.filter.feed(chunk))
        self._show(self.filter.flush())
        os.close(self.fd)

    def _show(self, data: bytes) -> None:
        if not data:
            return
        out = getattr(self.sink, "buffer", None)
        try:
            if out is not None:
                out.write(data)
            else:
                self.sink.write(data.decode("utf-8", "replace"))  # type: ignore[attr-defined]
            self.sink.flush()  # type: ignore[attr-defined]
        except (OSError, ValueError):
            pass


@dataclasses.dataclass
class _Console:
    """mpiexec's stdout and stderr write ends, and the tees that copy them to ours."""

    stdout: int
    stderr: int
    tees: list[_Tee]

    def tail(self) -> str:
        """The last lines mpiexec wrote (what the supervisor's judgement reads)."""
        return b"\n".join(t.tail for t in self.tees).decode("utf-8", "replace")


@contextlib.contextmanager
def _console(say: Callable[[str], None], prefix: str = "") -> Iterator[_Console]:
    """mpiexec's stdout and stderr write ends, copied to ours through :class:`_Tee` (NBC lines left out);
    at the end, one line (after ``prefix``) says how many were left out."""
    pipes = [os.pipe(), os.pipe()]
    tees = [_Tee(r, sink) for (r, _), sink in zip(pipes, (sys.stdout, sys.stderr))]
    for t in tees:
        t.start()
    try:
        yield _Console(pipes[0][1], pipes[1][1], tees)
    finally:
        for _, w in pipes:
            os.close(w)
        for t in tees:
            t.join(10)  # a rank elsewhere that still holds the pipe must not hold the launcher
        if (line := summary(sum(t.filter.dropped for t in tees))) is not None:
            say(f"[lightning-recover] {prefix}{line}")


class _Progress:
    """Committed steps seen as changes of the ledger file's mtime after ``since`` (the attempt's start)."""

    def __init__(self, ledger: str | None, since: float) -> None:
        self.ledger, self.since, self.changes = ledger, since, []  # type: ignore[var-annotated]

    def poll(self) -> None:
        if self.ledger is None:
            return
        try:
            mtime = os.stat(self.ledger).st_mtime
        except OSError:
            return
        if mtime > self.since and (not self.changes or mtime > self.changes[-1]):
            self.changes.append(mtime)

    @property
    def last(self) -> float | None:
        return self.changes[-1] if self.changes else None

    def first_after(self, t: float) -> float | None:
        return next((m for m in self.changes if m > t), None)


def _ledger_times(path: str | None) -> dict[int, float]:
    """step -> step_time_s of a ledger (a line cut short by a kill is skipped)."""
    times: dict[int, float] = {}
    if path is None or not os.path.exists(path):
        return times
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                times[int(rec["step"])] = float(rec.get("step_time_s", 0.0))
            except (ValueError, KeyError, TypeError):
                continue
    return times


def _started_at(status_dir: str) -> float | None:
    """When the last rank of an attempt had its communicator up (the newest ``started`` marker)."""
    times = [os.stat(os.path.join(status_dir, n)).st_mtime for n in os.listdir(status_dir) if n.startswith("started.")]
    return max(times) if times else None


#: How long the supervisor waits for a last world that already agreed on the end to finish leaving.
FINISHING_GRACE_S = 10.0


def settled_markers(status_dir: str, status: int, grace_s: float = FINISHING_GRACE_S) -> JobMarkers:
    """The attempt's markers, once a last world that was finishing has finished.

    mpiexec can end the job (a host lost with its daemon aborts it) while the survivors are
    past their last step: their leader has written ``done`` but not every member its ``ok``
    yet. Read at that moment the job looks lost and would be relaunched, only to find every
    step committed -- a relaunch for nothing beside ranks still leaving (seen in the host
    campaign). So a failed attempt whose ``done`` marker is there gets up to ``grace_s`` for
    the members' ``ok`` markers; without a ``done`` marker nothing is waited for."""
    markers = JobMarkers.read(status_dir)
    deadline = time.monotonic() + grace_s
    while status != 0 and markers.done is not None and not markers.finished and time.monotonic() < deadline:
        time.sleep(0.1)
        markers = JobMarkers.read(status_dir)
    return markers


def supervise(
    nprocs: int,
    command: Sequence[str],
    *,
    policy: SupervisionPolicy,
    checkpoint_dir: str,
    hosts: Sequence[Host] | None = None,
    ledger: str | None = None,
    resume_arg: str = DEFAULT_RESUME_ARG,
    stall_timeout_s: float | None = None,
    hang_timeout: float | None = None,
    extra: Sequence[str] = (),
    probe: Callable[[Sequence[Host], Sequence[str]], frozenset[str]] = probe_unreachable,
    status_root: str | None = None,
    unbound: bool = False,
) -> int:
    """``lightning-recover launch --supervise``: run the job; relaunch it from the newest checkpoint when it
    ends in a way a relaunch can cure; return its final status.

    Every attempt runs ``command`` under mpiexec with a fresh status directory and
    ``LIGHTNING_RECOVER_ATTEMPT`` set; a relaunch appends ``resume_arg`` when
    ``checkpoint_dir`` holds a complete checkpoint (else it starts over). After each attempt
    :func:`lightning_recover.cli.supervision.decide` judges it from the ranks' markers and the
    tail of mpiexec's output, the hosts :func:`~lightning_recover.cli.hosts.probe_unreachable` cannot reach are dropped,
    and one line says why and where the job goes next. With ``ledger`` the time each
    relaunch lost is measured (:class:`~lightning_recover.cli.supervision.RelaunchCost`), and
    with ``stall_timeout_s`` an attempt whose ledger gains no step for that long (counted
    from its start, so it must exceed start-up, restore and the slowest step with its
    checkpoint write) is ended and judged "stalled". ``hosts`` None: this machine only.
    ``status_root``: where the attempts' status directories go (default: a temporary
    directory here); on several hosts it must be a directory every host shares, or the
    markers of ranks elsewhere are lost; it is kept, with one ``attempt-K`` directory per
    attempt. ``unbound``: ranks run unbound (see :func:`~lightning_recover.cli.mpiexec.build_command`).
    """
    import tempfile

    if stall_timeout_s is not None and (ledger is None or not stall_timeout_s > 0):
        raise ValueError(f"--stall-timeout {stall_timeout_s} needs --ledger (the file whose growth is progress) and a positive value")
    sup = _Supervisor(nprocs, command, policy=policy, checkpoint_dir=checkpoint_dir, hosts=hosts, ledger=ledger,
                      resume_arg=resume_arg, stall_timeout_s=stall_timeout_s, hang_timeout=hang_timeout, extra=extra,
                      probe=probe, unbound=unbound)
    if status_root is not None:
        # Kept, with every attempt's markers (attempt-K/), as the plain launcher keeps it.
        os.makedirs(status_root, exist_ok=True)
        where: Any = contextlib.nullcontext(tempfile.mkdtemp(prefix="supervise-", dir=status_root))
    else:
        where = tempfile.TemporaryDirectory(prefix="lightning-recover-supervise-")
    with where as root:
        return sup.run(root)


@dataclasses.dataclass
class _Attempt:
    """One attempt of a supervised job: how it ran and how it ended (:meth:`_Supervisor._run_attempt`)."""

    number: int
    status_dir: str
    started: float
    progress: _Progress
    status: int = 0
    ended: float = 0.0
    #: The signal that ended the supervisor's job (Ctrl-C, a scheduler's SIGTERM), if one did.
    interrupted: int | None = None
    markers: JobMarkers | None = None
    outcome: Outcome | None = None

    @property
    def took(self) -> str:
        return f"attempt {self.number} ended after {self.ended - self.started:.1f} s"


class _Supervisor:
    """:func:`supervise`'s lifecycle: run an attempt, judge it, and relaunch it from the newest checkpoint
    or end; what carries over from one attempt to the next (the plan, the relaunch costs) lives here,
    the rest in each :class:`_Attempt`."""

    def __init__(
        self, nprocs: int, command: Sequence[str], *, policy: SupervisionPolicy, checkpoint_dir: str,
        hosts: Sequence[Host] | None, ledger: str | None, resume_arg: str, stall_timeout_s: float | None,
        hang_timeout: float | None, extra: Sequence[str], probe: Callable[[Sequence[Host], Sequence[str]], frozenset[str]],
        unbound: bool,
    ) -> None:
        self.nprocs, self.command, self.policy, self.checkpoint_dir = nprocs, command, policy, checkpoint_dir
        self.ledger, self.resume_arg, self.stall_timeout_s = ledger, resume_arg, stall_timeout_s
        self.hang_timeout, self.extra, self.probe, self.unbound = hang_timeout, extra, probe, unbound
        self.local = hosts is None
        # This machine alone: its slots are what the plain launcher allows (it oversubscribes past the cores).
        self.plan = first_plan(policy, hosts if hosts is not None else (Host("localhost", max(nprocs, os.cpu_count() or 1)),), nprocs)
        self.say = functools.partial(print, file=sys.stderr, flush=True)
        self.costs: list[RelaunchCost] = []
        #: The relaunch whose cost the next attempt completes.
        self.pending: dict[str, Any] | None = None
        self.relaunches = 0
        self.env_base = launch_env()

    def run(self, root: str) -> int:
        while True:
            att = self._run_attempt(os.path.join(root, f"attempt-{self.relaunches}"))
            if att.interrupted is not None:
                # The user (Ctrl-C) or the scheduler (SIGTERM: a cancelled or timed-out Slurm job) ended
                # the job: that is a decision, not a failure to repair.
                self.say(f"[lightning-recover] supervise: the job was ended by {signal.Signals(att.interrupted).name}; not relaunching")
                return 128 + att.interrupted
            self._note_relaunch_cost(att)
            assert att.outcome is not None
            cause = classify(att.outcome)
            unreachable = self.probe(self.plan.hosts, self.extra) if cause in RELAUNCHABLE and not self.local else frozenset()
            decision = decide(self.policy, self.plan, att.outcome, relaunches_done=self.relaunches, target_nprocs=self.nprocs,
                              unreachable=unreachable)
            if decision.action != "relaunch":
                return self._end(att, decision)
            if not self._relaunch(att, decision):
                return 128 + int(signal.SIGINT)

    def _run_attempt(self, status_dir: str) -> _Attempt:
        """Run one attempt under mpiexec to its end, its output teed through, the stall watchdog on."""
        os.makedirs(status_dir)
        plan = self.plan
        ckpt = newest_checkpoint(self.checkpoint_dir) if self.relaunches else None
        cmd = resume_command(self.command, self.resume_arg) if ckpt is not None else list(self.command)
        argv = build_command(
            plan.nprocs, cmd, hang_timeout=self.hang_timeout, extra=self.extra, hosts=None if self.local else host_arg(plan.hosts),
            slots=plan.slots, oversubscribe=self.policy.oversubscribe and not self.local, unbound=self.unbound,
        )
        self.say(f"[lightning-recover] supervise: attempt {self.relaunches + 1}: " + shlex.join(argv))
        if self.relaunches == 0 and (note := safe_coll_note(argv)) is not None:
            self.say(f"[lightning-recover] {note}")
        env = dict(_with_spare_hosts(self.env_base, None if self.local else plan.hosts, plan.nprocs),
                   **{ENV_STATUS_DIR: status_dir, ENV_ATTEMPT: str(self.relaunches)})
        t_start = time.time()
        att = _Attempt(self.relaunches + 1, status_dir, t_start, _Progress(self.ledger, t_start))
        interrupted: list[int] = []
        start = StartWatch(status_dir, plan.nprocs, all_local=self.local and not spans_hosts(argv))
        with _console(self.say, prefix=f"supervise: attempt {att.number}: ") as console:
            att.status = run_supervised(argv, env, nprocs=plan.nprocs if self.local else None, watch=lambda: self._watch(att),
                                        stdout=console.stdout, stderr=console.stderr, on_signal=interrupted.append,
                                        finished=lambda: JobMarkers.read(status_dir).over(plan.nprocs),
                                        refused=lambda: JobMarkers.read(status_dir).refused, start_watch=start.poll)
        att.ended = time.time()
        att.progress.poll()
        if interrupted:
            att.interrupted = interrupted[0]
            return att
        att.markers = markers = start.local_hosts(settled_markers(status_dir, att.status))
        att.outcome = Outcome(
            plan.nprocs, att.status, console.tail(), started=frozenset(markers.started), ok=frozenset(markers.ok),
            exited=frozenset(markers.ended - markers.ok), no_quorum=frozenset(markers.no_quorum),
            raised={r: s for r, (_, s) in markers.raised.items()}, stalled=att.status == STALLED_STATUS,
            lost_at_start=att.status == START_LOST_STATUS or bool(markers.lost_at_start),
        )
        return att

    def _watch(self, att: _Attempt) -> str | None:
        """The stall watchdog, polled while the attempt runs: why to end it, or None."""
        att.progress.poll()
        if self.stall_timeout_s is None:
            return None
        quiet = time.time() - (att.progress.last or att.started)
        if quiet > self.stall_timeout_s:
            return (f"supervise: stall watchdog: no committed step for {quiet:.0f} s (> --stall-timeout "
                    f"{self.stall_timeout_s:g}; ledger {self.ledger})")
        return None

    def _note_relaunch_cost(self, att: _Attempt) -> None:
        """An attempt that was a relaunch completes the cost of that relaunch: how long until it was back."""
        pending, self.pending = self.pending, None
        if pending is None or self.ledger is None:
            return
        started = _started_at(att.status_dir)
        first = att.progress.first_after(started) if started is not None else None
        own = _ledger_times(self.ledger).get(pending["resume_step"] or 0, 0.0)
        self.costs.append(RelaunchCost(
            pending["detection_s"],
            (started if started is not None else att.ended) - pending["ended"],
            max(0.0, first - started - own) if first is not None and started is not None else float("nan"),
            pending["replayed"], pending["replay_s"],
        ))

    def _end(self, att: _Attempt, decision: Decision) -> int:
        """The job finished, or the supervisor gives up: the final lines and status."""
        assert att.markers is not None
        status, words = final_words(att.markers, self.plan.nprocs, att.status)
        if decision.action == "done":
            if words is not None:
                self.say(f"[lightning-recover] {words}")
            lost = sum(c.total_s for c in self.costs)
            measured = f"time lost to failures {lost:.1f} s" if self.ledger is not None else "give --ledger to measure the time lost"
            self.say(f"[lightning-recover] supervise: {att.took}: the job finished after {self.relaunches} relaunch(es); {measured}")
        else:
            status = status or 1
            self.say(f"[lightning-recover] supervise: {att.took}: giving up: {decision.reason}. Exit status {status}")
        for i, c in enumerate(self.costs, 1):
            self.say(f"[lightning-recover] supervise: relaunch {i} cost {c.describe()}")
        return status

    def _relaunch(self, att: _Attempt, decision: Decision) -> bool:
        """Say where the job goes next and what it lost, wait the backoff, and take the new plan;
        False when interrupted while waiting."""
        assert decision.plan is not None
        resume = newest_checkpoint(self.checkpoint_dir)
        resume_step = checkpoint_step(os.path.basename(resume)) if resume is not None else None
        replayed, replay_s = replayed_steps(_ledger_times(self.ledger), resume_step) if self.ledger else (0, 0.0)
        detection = att.ended - (att.progress.last or att.started)
        self.pending = {"ended": att.ended, "detection_s": detection, "resume_step": resume_step, "replayed": replayed,
                        "replay_s": replay_s}
        so_far = sum(c.total_s for c in self.costs) + detection + replay_s
        source = f"checkpoint {resume}" if resume is not None else "the start (no checkpoint yet)"
        lost_line = (
            f"time lost so far {so_far:.1f} s (detection {detection:.1f} s, {replayed} step(s) to replay)"
            if self.ledger is not None else "give --ledger to measure the time lost"
        )
        self.say(
            f"[lightning-recover] supervise: {att.took}: {decision.reason}; relaunch {self.relaunches + 1}/{self.policy.max_relaunches} "
            f"in {decision.backoff_s:.1f} s: {decision.plan.nprocs} rank(s) on {host_arg(decision.plan.hosts)} from {source}; "
            f"{lost_line}"
        )
        try:
            time.sleep(decision.backoff_s)
        except KeyboardInterrupt:
            self.say("[lightning-recover] supervise: interrupted while waiting to relaunch; not relaunching")
            return False
        self.plan = decision.plan
        self.relaunches += 1
        return True
