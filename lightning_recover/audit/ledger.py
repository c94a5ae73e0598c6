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
joined replica ``{"replica", "transfer_s", "pause_s", "ok"}`` with the seconds the state
transfer took and the survivors' pause (null where not measured), and whether the joiner
committed that step (false: it died first and is among the step's faults).
"""

from __future__ import annotations

import json
import os
from typing import Any

from lightning_recover.errors import RecoverError

__all__ = ["JOIN_FIELDS", "LEDGER_FIELDS", "LedgerFormatError", "read_ledger"]

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


class LedgerFormatError(RecoverError, ValueError):
    """A ledger file that cannot be parsed (not JSON lines of objects)."""


def read_ledger(path: str | os.PathLike[str], *, torn_tail: bool = False) -> list[dict[str, Any]]:
    """All records of a ledger, in file order; blank lines are skipped.

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
    return records
