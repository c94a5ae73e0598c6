"""The step ledger's format and its reader: one JSON line per committed step.

The ledger is the evidence that recovery kept the optimisation exact: for StaticWorld every
committed step applied exactly the B microbatch ids it owns (t*B .. t*B+B-1), once each,
whatever failed; with a fault-free reference ledger, the loss trajectories can be compared
step by step. The leader writes it (:mod:`lightning_recover.audit.ledger_writer`, which
states what survives a crash) and `lightning-recover check-ledger` audits it
(:mod:`lightning_recover.audit.ledger_check`). This module is the contract both share: the
fields of a line (:data:`LEDGER_FIELDS`, :data:`JOIN_FIELDS`) and how a file is read back
(:func:`read_ledger`, which also drops the torn tail an OS crash can leave). Pure Python, no torch.

Hot re-join adds two optional fields (absent from older ledgers): ``joined``, the replicas
admitted at the boundary before the step (from the policy), and ``joins``, one object per
joined replica ``{"replica", "transfer_s", "pause_s", "ok", "spawned"}`` with the seconds the state
transfer took and the survivors' pause (null where not measured), whether the joiner
committed that step (false: it died first and is among the step's faults), and (optional)
how many processes were spawned to seat it: S, fewer when salvage's orphans filled the other
ranks, 0 when orphans alone re-formed it.

Two line formats, both read everywhere:

* **compact** (written since the scale work): the committed ids as half-open ranges
  (``ids``: ``[[t*B, t*B+B]]`` in a StaticWorld step), and ``membership``, the step of the
  line that holds the step's membership (``members``: the plan order as ranges of replicas,
  and the counts the roles follow from, see
  :class:`~lightning_recover.workload.step_plan.Membership`). Only the first line of a
  membership carries ``members``; a step that lost replicas lists them in ``died`` and the
  roles it changed in ``role_changes``. A steady line is a few hundred bytes whatever W and B.
* **full** (older ledgers): every id in ``microbatch_ids``, every replica and role.

:func:`read_ledger` resolves compact lines to the full ``replicas`` and ``roles`` (shared
by the steady lines of one membership, so resolving costs O(W) per membership, not per
line); the ids stay ranges (:func:`id_ranges`, :func:`microbatch_ids` expand them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from lightning_recover.errors import RecoverError
from lightning_recover.workload.step_plan import Membership, expand_ranges, ranges_of

__all__ = [
    "COMPACT_FIELDS",
    "JOIN_FIELDS",
    "LEDGER_FIELDS",
    "LedgerFormatError",
    "MembershipTable",
    "id_ranges",
    "is_compact",
    "microbatch_ids",
    "read_ledger",
    "required_fields",
    "resolve",
]

#: Optional per-line fields of hot re-join (see the module docstring).
JOIN_FIELDS: tuple[str, ...] = ("joined", "joins")

LEDGER_FIELDS: tuple[str, ...] = (
    "step",
    "loss",
    "B",
    "committed",
    "microbatch_ids",
    "replicas",
    "world_epoch",
    "roles",
    "faults",
    "extra_microbatches",
    "step_time_s",
    "recovery_s",
)

#: The fields of a compact line (see the module docstring), in place of LEDGER_FIELDS.
COMPACT_FIELDS: tuple[str, ...] = (
    "step",
    "loss",
    "B",
    "committed",
    "ids",
    "membership",
    "world_epoch",
    "faults",
    "extra_microbatches",
    "step_time_s",
    "recovery_s",
)


def is_compact(rec: Mapping[str, Any]) -> bool:
    return "membership" in rec


def required_fields(rec: Mapping[str, Any]) -> tuple[str, ...]:
    return COMPACT_FIELDS if is_compact(rec) else LEDGER_FIELDS


def id_ranges(rec: Mapping[str, Any]) -> list[tuple[int, int]]:
    """The committed ids of a line of either format, as sorted half-open ranges."""
    if "ids" in rec:
        return [(int(lo), int(hi)) for lo, hi in rec["ids"]]
    return ranges_of(sorted(set(rec["microbatch_ids"])))


def microbatch_ids(rec: Mapping[str, Any]) -> list[int]:
    """Every committed id of a line of either format (O(B): for small ledgers and tests)."""
    if "ids" in rec:
        return expand_ranges(rec["ids"])
    return list(rec["microbatch_ids"])


class MembershipTable:
    """The memberships a ledger has defined so far, to resolve its compact lines in order."""

    def __init__(self) -> None:
        # step of the defining line -> (replicas, roles), shared by every line that refers to it
        self._known: dict[int, tuple[list[int], dict[str, str]]] = {}
        self._latest: int | None = None

    def resolve(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        """``rec`` with full ``replicas`` and ``roles``; a full-format line is returned as is.

        Raises LedgerFormatError for a line that refers to a membership no earlier line holds."""
        if not is_compact(rec):
            return dict(rec)
        since = rec["membership"]
        if "members" in rec:
            try:
                m = Membership.from_json(rec["members"])
            except (KeyError, TypeError, ValueError) as exc:
                raise LedgerFormatError(f"step {rec.get('step')}: members is not a membership record ({exc!r})") from None
            self._known[since] = (list(m.live), {str(r): role.value for r, role in sorted(m.roles().items())})
            self._latest = since
        elif since != self._latest and since in self._known:
            raise LedgerFormatError(
                f"step {rec.get('step')}: refers to the membership of step {since!r}, but the latest membership "
                f"line is step {self._latest!r}; the ledger mixes lines of different runs"
            )
        found = self._known.get(since)
        if found is None:
            raise LedgerFormatError(
                f"step {rec.get('step')}: refers to the membership of step {since!r}, which no earlier line "
                f"holds; the ledger was cut before that line (read it from its start)"
            )
        replicas, roles = found
        died, changes = rec.get("died") or (), rec.get("role_changes") or {}
        if died or changes:
            gone = set(died)
            replicas = [r for r in replicas if r not in gone]
            roles = {k: v for k, v in roles.items() if int(k) not in gone}
            roles.update(changes)
        return {**rec, "replicas": replicas, "roles": roles}


def resolve(records: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """Records of either format, in order, with full ``replicas`` and ``roles`` (see MembershipTable)."""
    table = MembershipTable()
    for rec in records:
        yield table.resolve(rec)


class LedgerFormatError(RecoverError, ValueError):
    """A ledger file that cannot be parsed (not JSON lines of objects)."""


def read_ledger(path: str | os.PathLike[str], *, torn_tail: bool = False, raw: bool = False) -> list[dict[str, Any]]:
    """All records of a ledger, in file order; blank lines are skipped.

    Compact lines come back resolved (full ``replicas`` and ``roles``) unless ``raw``: the
    lines exactly as written (what a writer copies back).

    ``torn_tail=True`` drops unreadable lines at the end of the file (what an OS crash can
    leave of lines not yet fsync'ed); an unreadable line followed by a good one is still an error.
    """
    records: list[dict[str, Any]] = []
    torn: LedgerFormatError | None = None
    # Undecodable bytes (a torn multi-byte character) become a line that is not JSON, not a UnicodeDecodeError.
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                error = LedgerFormatError(
                    f"{path}:{lineno}: not a JSON line ({exc.msg}); the ledger is corrupt or "
                    f"was not written by LedgerWriter"
                )
                if not torn_tail:
                    raise error from None
                torn = torn or error
                continue
            if torn is not None:
                raise torn
            if not isinstance(rec, dict):
                raise LedgerFormatError(
                    f"{path}:{lineno}: expected a JSON object per line, got "
                    f"{type(rec).__name__}"
                )
            records.append(rec)
    return records if raw else list(resolve(records))
