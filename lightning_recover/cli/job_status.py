"""What the ranks' status markers say about a finished job: its exit status and the launcher's last line.

Each rank of a job leaves small marker files in the launcher's status directory
(:mod:`lightning_recover.runtime.markers`): ``started``, ``ok``, ``exited`` (``no quorum``
when its side of a failure lost the quorum), ``raised`` and the last world's ``done``.
With ULFM, mpiexec reports 0 even when every rank died by a signal (each death is a
"recoverable" failure), so the launcher judges a job by these markers instead:
:class:`JobMarkers` reads them, and :func:`final_words` turns them into the job's status
(non-zero -- mpiexec's, else 1 -- when ranks started but none ended on purpose,
:data:`NO_QUORUM_STATUS` when they stopped for want of a quorum and none finished,
:data:`~lightning_recover.runtime.refusal.REFUSED_STATUS` when a setting was refused) and one
line saying whether the program raised or the replicas died.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_recover.runtime.markers import QUORUM_MARKER, START_LOST_MARKER
from lightning_recover.runtime.refusal import REFUSED_STATUS


#: The job's status when ranks stopped for want of a quorum and none finished (EX_TEMPFAIL).
NO_QUORUM_STATUS = 75
#: The job's status when a rank was lost while the job started, before the communicator came up (EX_UNAVAILABLE).
START_LOST_STATUS = 69


@dataclass
class JobMarkers:
    """What the ranks of one job left in the status directory (see :data:`lightning_recover.runtime.markers.ENV_STATUS_DIR`)."""

    started: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # ok or exited: the rank ended on purpose
    ok: set[int] = field(default_factory=set)  # ended with status 0
    no_quorum: set[int] = field(default_factory=set)  # exited: its side of a cut had no quorum
    done: frozenset[int] | None = None  # the last world's members, from its leader's done marker
    #: rank -> (exception type name, the traceback's last line)
    raised: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: rank -> "HOST PID" from its ``init`` marker (the strategy started it, before MPI_Init)
    init: dict[int, str] = field(default_factory=dict)
    #: of ``exited``: rank -> what it saw lost while the job started (``lost at start: ...``)
    lost_at_start: dict[int, str] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: str) -> JobMarkers:
        markers = cls()
        for name in os.listdir(directory):
            what, _, rank = name.partition(".")
            if not rank.isdigit():
                continue  # e.g. printed.<digest>: a rank's claim to print one traceback
            r = int(rank)
            if what == "started":
                markers.started.add(r)
            elif what == "init":
                markers.init[r] = _read_text(os.path.join(directory, name)).strip()
            elif what == "done":
                members = _read_text(os.path.join(directory, name)).split(",")
                if all(m.strip().isdigit() for m in members):
                    markers.done = frozenset(int(m) for m in members)
            elif what in ("ok", "exited"):
                markers.ended.add(r)
                if what == "ok":
                    markers.ok.add(r)
                else:
                    text = _read_text(os.path.join(directory, name))
                    if text.startswith(QUORUM_MARKER):
                        markers.no_quorum.add(r)
                    elif text.startswith(START_LOST_MARKER):
                        markers.lost_at_start[r] = text
            elif what == "raised":
                try:
                    with open(os.path.join(directory, name)) as f:
                        lines = f.read().splitlines()
                except OSError:
                    lines = []
                kind = lines[0] if lines else "an exception"
                markers.raised[r] = (kind, lines[1] if len(lines) > 1 else kind)
        return markers

    @property
    def refused(self) -> bool:
        """A rank stopped on a setting (a ConfigurationError; :mod:`lightning_recover.runtime.refusal`): it printed
        the one line naming the setting and the fix, and the job's status is :data:`REFUSED_STATUS`."""
        return any(kind == "ConfigurationError" for kind, _ in self.raised.values())

    @property
    def finished(self) -> bool:
        """The last world ended the job and every one of its members left normally."""
        return self.done is not None and self.done <= self.ok

    def over(self, nprocs: int) -> bool:
        """The job can do nothing more: its last world finished, or every one of its ``nprocs``
        ranks left a final marker (ok, exited -- e.g. every side stopped for want of quorum --
        or raised)."""
        return self.finished or set(range(nprocs)) <= (self.ended | set(self.raised))


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _rank_list(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 0, 2`` / ``ranks 0-3``."""
    ordered = sorted(ranks)
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"ranks {ordered[0]}-{ordered[-1]}"
    return "ranks " + ", ".join(map(str, ordered))


def _what_raised(raised: Mapping[int, tuple[str, str]], nprocs: int) -> str:
    """``ValueError on every rank (ValueError: bad)``, or per kind with its ranks when they differ."""
    by_summary: dict[tuple[str, str], list[int]] = {}
    for rank, kind in raised.items():
        by_summary.setdefault(kind, []).append(rank)
    parts = []
    for (kind, summary), ranks in sorted(by_summary.items(), key=lambda item: min(item[1])):
        where = "every rank" if len(by_summary) == 1 and set(ranks) == set(range(nprocs)) else _rank_list(ranks)
        parts.append(f"{kind} on {where} ({summary})")
    return " and ".join(parts)


def host_of(markers: JobMarkers, rank: int) -> str:
    """Where ``rank`` ran, from its ``init`` marker; a rank that never left one never reached the strategy."""
    where = markers.init.get(rank, "").split()
    return f"on host {where[0]}" if where else "(host unknown: it never reached the strategy's start)"


def named_lost(markers: JobMarkers, nprocs: int) -> list[int]:
    """The ranks the survivors' ``lost at start`` markers name; else those that never brought a communicator
    up and did not say so themselves."""
    named: set[int] = set()
    for text in markers.lost_at_start.values():
        inside = text.partition("[")[2].partition("]")[0]
        named |= {int(x) for x in inside.split(",") if x.strip().isdigit()}
    return sorted(named) or sorted(set(range(nprocs)) - markers.started - set(markers.lost_at_start))


def start_lost_line(markers: JobMarkers, nprocs: int, lost: Sequence[int] | None = None, why: str = "") -> str:
    """The one line for a job that lost ranks while it started (before the communicator came up): which
    ranks and hosts, and the fix. ``lost``: the ranks the launcher saw go (default: those the ranks named)."""
    if lost is None:
        lost = named_lost(markers, nprocs)
    who = ", ".join(f"rank {r} {host_of(markers, r)}" for r in lost) or "a rank"
    return (
        f"lost while the job started, before its first step: {who}{why}; the world is fixed when MPI starts, so the "
        "other ranks cannot start without it and were ended. Fix what stopped it (its output above: a broken node, "
        "a failed import, out of memory at start), then relaunch; `lightning-recover launch --supervise` relaunches "
        f"by itself. Exit status {START_LOST_STATUS}"
    )


def final_words(markers: JobMarkers, nprocs: int, status: int) -> tuple[int, str | None]:
    """The job's status and the launcher's last line about it, from the markers.

    A job failed when ranks started (or raised) but none ended on purpose; the line then
    says whether the program raised (its exception, traceback above) or the replicas died.
    When some ranks raised but others finished, the line notes the exception and the
    status stays. ``None``: nothing to add.
    """
    if markers.no_quorum and not markers.ok:
        # The side that stopped cannot know whether another side went on (it lost contact):
        # only the ranks' files of a world that finished would say so, and none did here.
        return NO_QUORUM_STATUS, (
            f"{_rank_list(sorted(markers.no_quorum))} stopped for want of a quorum (a host lost or cut off "
            "with half the replicas, the leader's among them) and no rank finished; relaunch from the newest "
            f"checkpoint (ckpt_path=last), or let `lightning-recover launch --supervise` do it. Exit status {NO_QUORUM_STATUS}"
        )
    if markers.no_quorum and markers.finished and status != 0:
        # The side that stopped handed mpiexec its status 75 (a cut that healed), or mpiexec lost
        # that side's daemon behind the cut (seen: 250); either way the last world finished every
        # step: the job succeeded.
        return 0, (
            f"note: {_rank_list(sorted(markers.no_quorum))} stopped for want of a quorum while cut off; "
            "the last world went on without them and finished"
        )
    if status == START_LOST_STATUS and not markers.ok:
        return status, None  # the launcher's start watch ended the job and printed its line
    if markers.lost_at_start and not markers.ok:
        return START_LOST_STATUS, start_lost_line(markers, nprocs)
    failed = bool(markers.started or markers.raised) and not markers.ended
    if not failed:
        if markers.raised:
            many = "s" if len(markers.raised) > 1 else ""
            return status, (
                f"note: the program raised {_what_raised(markers.raised, nprocs)}, traceback{many} above; "
                "the other replicas went on without those ranks and finished"
            )
        if status != 0 and markers.ended and markers.ended == markers.ok:
            # The runtime's own status after a replacement spawn it could not place (hot re-join):
            # the program ended normally on every rank that finished, so the job did too.
            return 0, f"note: mpiexec exited with status {status} (a failed spawn of replacement ranks); every rank that finished ended normally"
        return status, None
    if markers.refused:
        return REFUSED_STATUS, None  # the rank's one line says which setting and the fix; a traceback would not help
    status = status or 1
    if not markers.raised:
        return status, (
            "every rank of the job failed: no replica survived to continue in place: the replicas died (killed by a "
            "signal or lost with their node; no rank raised an exception); relaunch from the newest checkpoint "
            f"(ckpt_path=last, recover.checkpoint.dir). Exit status {status}"
        )
    died = sorted((markers.started | set(range(nprocs))) - set(markers.raised))
    rest = f"; {_rank_list(died)} died or left through the replica-consistency gate" if died else ""
    many = "s" if len(set(markers.raised.values())) > 1 else ""
    return status, (
        f"the program raised {_what_raised(markers.raised, nprocs)}, traceback{many} above{rest}; "
        f"fix the error, then relaunch (from the newest checkpoint: ckpt_path=last). Exit status {status}"
    )
