"""``lightning-recover check-ledger``: the audit that a run's ledger is exactly-once.

It reads a ledger (:mod:`lightning_recover.audit.ledger`) and checks, line by line, what
recovery promises: consecutive steps, a constant B, and for StaticWorld exactly the B
microbatch ids each step owns, once each, whatever failed; optionally the losses against a
fault-free reference ledger. Both line formats are checked (compact lines by their id
ranges, in O(ranges) a line, so 10^5 steps of B = 262,144 check in seconds). The checker keeps its exactly-once checks for every step,
joins or not, and checks the hot re-join fields are consistent (see
:data:`~lightning_recover.audit.ledger.JOIN_FIELDS`). `lightning-recover check-ledger` is
:func:`main` here. Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_recover.audit.ledger import LedgerFormatError, MembershipTable, read_ledger, required_fields

__all__ = ["LedgerVerdict", "check_ledger", "main"]

#: The loss tolerance for a run's precision (the ledger's ``precision``, Lightning's name for it):
#: a recovered step sums the same gradients in another grouping, exact to float roundoff, which
#: a low-precision run amplifies (bf16-mixed: within 1.3e-4 after one recovered step, seen with a
#: transformers LLaMA; a long run drifts further). fp32 keeps the old default.
RTOL_BY_PRECISION: dict[str, float] = {
    "64-true": 1e-8, "64": 1e-8,
    "32-true": 1e-4, "32": 1e-4,
    "16-mixed": 5e-3, "16-true": 5e-3, "16": 5e-3,
    "bf16-mixed": 1e-2, "bf16-true": 1e-2, "bf16": 1e-2,
}
DEFAULT_RTOL = RTOL_BY_PRECISION["32-true"]

_MAX_PRINTED_PROBLEMS = 20
_MAX_LISTED_IDS = 10


@dataclass
class LedgerVerdict:
    """Outcome of check_ledger; `summary_line()` is the one-line verdict the CLI prints last."""

    ok: bool
    steps: int
    first_bad_step: int | None
    problems: list[str]
    B: int | None = None
    policy: str = "static"
    first_step: int | None = None
    last_step: int | None = None
    reference: str | None = None
    rtol: float = DEFAULT_RTOL
    #: Where ``rtol`` came from: "--rtol", or the precision the ledger records.
    rtol_source: str = "default"
    #: Replicas admitted by hot re-join over the ledger (the lines' ``joined``).
    joins: int = 0
    # The problem that names first_bad_step (or the first one), for the verdict line.
    headline: str | None = field(default=None, repr=False)

    def summary_line(self) -> str:
        if self.ok:
            span = f"steps {self.first_step}-{self.last_step}" if self.steps else "no steps"
            line = f"ledger OK: {self.steps} steps, B={self.B}, {span}, policy {self.policy}"
            if self.joins:
                line += f", {self.joins} join{'s' if self.joins != 1 else ''}"
            if self.reference is not None:
                line += f", loss matches the reference within rtol={self.rtol:g} ({self.rtol_source})"
            return line
        head = self.headline or (self.problems[0] if self.problems else "unknown problem")
        more = f" ({len(self.problems)} problems)" if len(self.problems) > 1 else ""
        if self.first_bad_step is not None:
            return f"ledger BAD: first bad step {self.first_bad_step}: {head}{more}"
        return f"ledger BAD: {head}{more}"


def _fmt_ids(ids: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:_MAX_LISTED_IDS])
    more = f", ... ({len(ids)} in all)" if len(ids) > _MAX_LISTED_IDS else ""
    return f"[{shown}{more}]"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Problems:
    """Problems tagged with the step they concern (None when no single step is to blame)."""

    def __init__(self) -> None:
        self.items: list[tuple[int | None, str]] = []

    def add(self, step: int | None, text: str) -> None:
        self.items.append((step, text))

    def verdict(self, **kw: Any) -> LedgerVerdict:
        steps_with = [s for s, _ in self.items if s is not None]
        first = min(steps_with) if steps_with else None
        headline = None
        for s, text in self.items:
            if s == first:
                headline = text
                break
        rendered = [f"step {s}: {t}" if s is not None else t for s, t in self.items]
        return LedgerVerdict(
            ok=not self.items, first_bad_step=first, problems=rendered, headline=headline, **kw
        )


def _check_ids(
    problems: _Problems, step: int, ids: list[Any], B: int, committed: Any, policy: str
) -> None:
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        problems.add(step, "microbatch_ids must be a list of integers")
        return
    expected = range(step * B, step * B + B)
    counts = Counter(ids)
    dups = sorted(i for i, c in counts.items() if c > 1)
    outside = sorted(i for i in counts if i not in expected)
    if dups:
        problems.add(step, f"duplicated microbatch ids {_fmt_ids(dups)}")
    if outside:
        problems.add(
            step,
            f"microbatch ids outside the step's range {expected.start}..{expected.stop - 1}: "
            f"{_fmt_ids(outside)}",
        )
    if policy == "static":
        missing = [i for i in expected if i not in counts]
        if missing:
            problems.add(step, f"missing microbatch ids {_fmt_ids(missing)}")
    if _is_int(committed) and committed != len(ids):
        problems.add(step, f"committed={committed} but {len(ids)} microbatch ids are listed")


def _check_id_ranges(problems: _Problems, step: int, ranges: Any, B: int, committed: Any, policy: str) -> None:
    """A compact line's ids: sorted disjoint ranges inside the step's block; all of it for static."""
    if not isinstance(ranges, list) or not all(
        isinstance(x, list) and len(x) == 2 and all(_is_int(v) for v in x) and x[0] < x[1] for x in ranges
    ):
        problems.add(step, f"ids must be a list of [start, stop) ranges of integers, got {str(ranges)[:80]}")
        return
    lo, hi = step * B, step * B + B
    total, prev_stop = 0, None
    for start, stop in ranges:
        if prev_stop is not None and start < prev_stop:
            problems.add(step, f"microbatch id ranges overlap or are out of order at [{start}, {stop}): ids applied twice")
            return
        if start < lo or stop > hi:
            problems.add(step, f"microbatch ids [{start}, {stop}) outside the step's range {lo}..{hi - 1}")
            return
        total += stop - start
        prev_stop = stop
    if policy == "static" and total != B:
        problems.add(step, f"missing microbatch ids: {B - total} of the step's {B} are not committed")
    if _is_int(committed) and committed != total:
        problems.add(step, f"committed={committed} but the id ranges hold {total} ids")


def _check_joins(problems: _Problems, step: int, rec: Mapping[str, Any], prev: Mapping[str, Any] | None) -> int:
    """The re-join fields of one line; returns how many replicas it admits."""
    joined = rec.get("joined", [])
    if joined == [] and not rec.get("joins"):
        return 0  # the common line: nothing to check (and no O(W) set of its replicas)
    if not isinstance(joined, list) or not all(_is_int(r) for r in joined):
        problems.add(step, f"joined must be a list of replica indices, got {joined!r}")
        return 0
    if len(set(joined)) != len(joined):
        problems.add(step, f"joined lists a replica twice: {joined}")
    replicas, faults = rec.get("replicas"), rec.get("faults")
    if isinstance(replicas, list) and isinstance(faults, list):
        unaccounted = sorted(set(joined) - set(replicas) - set(faults))
        if unaccounted:
            problems.add(step, f"joined replicas {unaccounted} neither committed the step nor are among its faults")
    if prev is not None and isinstance(prev.get("replicas"), list) and isinstance(faults, list):
        # A replica already live can only be replaced after its loss is recorded.
        live_again = sorted((set(joined) & set(prev["replicas"])) - set(faults))
        if live_again:
            problems.add(
                step,
                f"joined replicas {live_again} were live in step {prev.get('step')} and are not among this "
                f"step's faults (a joiner takes a lost replica's index)",
            )
    joins = rec.get("joins")
    if joins is not None:
        if not isinstance(joins, list) or not all(isinstance(j, dict) for j in joins):
            problems.add(step, f"joins must be a list of objects, got {joins!r}")
        else:
            listed = [j.get("replica") for j in joins]
            if listed != joined:
                problems.add(step, f"joins are for replicas {listed} but joined is {joined}")
            for j in joins:
                ok = j.get("ok")
                in_step = isinstance(replicas, list) and j.get("replica") in replicas
                if ok is not None and ok is not in_step:
                    problems.add(step, f"join of replica {j.get('replica')}: ok is {ok!r} but the replica {'did' if in_step else 'did not'} commit the step")
                for key in ("transfer_s", "pause_s"):
                    v = j.get(key)
                    if v is not None and not (_is_number(v) and v >= 0):
                        problems.add(step, f"join of replica {j.get('replica')}: {key} must be seconds >= 0 or null, got {v!r}")
                spawned = j.get("spawned")
                if spawned is not None and not (_is_int(spawned) and spawned >= 0):
                    problems.add(step, f"join of replica {j.get('replica')}: spawned must be a process count >= 0, got {spawned!r}")
    return len(joined)


def rtol_for(records: Sequence[Mapping[str, Any]]) -> tuple[float, str]:
    """The loss tolerance for the precision a ledger records (the loosest of its lines), and why."""
    found = {str(r["precision"]) for r in records if r.get("precision") is not None}
    known = {p: RTOL_BY_PRECISION[p] for p in found if p in RTOL_BY_PRECISION}
    if not known:
        return DEFAULT_RTOL, "the default for fp32; the ledger records no precision"
    precision = max(known, key=known.__getitem__)
    return known[precision], f"for {precision} precision"


def check_ledger(
    path: str | os.PathLike[str],
    reference: str | os.PathLike[str] | None = None,
    rtol: float | None = None,
    policy: str | None = None,
) -> LedgerVerdict:
    """Audit a ledger: exactly-once ids and constant B (StaticWorld), optionally vs a reference.

    `policy` overrides the per-line "policy" key (default "static"); AdaptiveWorld lines are
    only checked for ids that are unique, inside their step's range and counted right.
    `rtol` None: the tolerance fits the precision the ledger records (:data:`RTOL_BY_PRECISION`).
    """
    problems = _Problems()
    ref_name = os.fspath(reference) if reference is not None else None
    try:
        records = read_ledger(path, raw=True)
    except (OSError, LedgerFormatError) as exc:
        problems.add(None, f"cannot read ledger: {exc}")
        records = None
    if records == []:
        problems.add(None, f"ledger {os.fspath(path)} has no steps")
    if not records:
        return problems.verdict(steps=0, reference=ref_name, rtol=rtol if rtol is not None else DEFAULT_RTOL)
    rtol, rtol_source = (rtol, "--rtol") if rtol is not None else rtol_for(records)

    # The run's B is the most common one, so a single bad line is blamed, not all others.
    Bs = Counter(r["B"] for r in records if _is_int(r.get("B")) and r["B"] > 0)
    lines = _LineChecks(problems, Bs.most_common(1)[0][0] if Bs else None, policy)
    for lineno, raw in enumerate(records, 1):
        lines.check(lineno, raw)
    if reference is not None:
        _compare_losses(problems, lines.losses, ref_name or "", rtol)
    return problems.verdict(
        steps=len(records),
        B=lines.run_B,
        policy="/".join(sorted(lines.policies)) or "static",
        first_step=lines.steps_seen[0] if lines.steps_seen else None,
        last_step=lines.steps_seen[-1] if lines.steps_seen else None,
        reference=ref_name,
        rtol=rtol,
        rtol_source=rtol_source,
        joins=lines.joins,
    )


class _LineChecks:
    """:func:`check_ledger`'s pass over the lines, in order: what each line is checked against (the run's B,
    the previous line) and what the verdict needs of them (policies, losses, steps, joins)."""

    def __init__(self, problems: _Problems, run_B: int | None, policy: str | None) -> None:
        self.problems, self.run_B, self.policy = problems, run_B, policy
        self.table = MembershipTable()
        self.policies: set[str] = set()
        self.losses: dict[int, Any] = {}
        self.steps_seen: list[int] = []
        self.prev_step: int | None = None
        self.prev_rec: dict[str, Any] | None = None
        self.joins = 0

    def check(self, lineno: int, raw: dict[str, Any]) -> None:
        problems = self.problems
        step = raw.get("step")
        try:
            rec = self.table.resolve(raw)
        except LedgerFormatError as exc:
            problems.add(step if _is_int(step) else None, f"line {lineno}: {exc}")
            rec = dict(raw)
        if not _is_int(step) or step < 0:
            problems.add(
                self.prev_step + 1 if self.prev_step is not None else None,
                f"line {lineno}: step must be a non-negative integer, got {step!r}",
            )
            return
        missing = [k for k in required_fields(rec) if k not in rec]
        if missing:
            problems.add(step, f"missing fields {missing}")
        if self.prev_step is not None and step != self.prev_step + 1:
            problems.add(step, f"steps are not consecutive: step {step} follows step {self.prev_step}")
        self.joins += _check_joins(problems, step, rec, self.prev_rec if self.prev_step == step - 1 else None)
        self.prev_step, self.prev_rec = step, rec
        self.steps_seen.append(step)
        line_policy = self.policy or rec.get("policy", "static")
        if line_policy not in ("static", "adaptive"):
            problems.add(step, f"unknown policy {line_policy!r}; expected static or adaptive")
            line_policy = "static"
        self.policies.add(line_policy)
        self.losses[step] = rec.get("loss")
        self._check_counts(step, rec, line_policy)

    def _check_counts(self, step: int, rec: Mapping[str, Any], line_policy: str) -> None:
        """B constant, the committed count the policy allows, and the microbatch ids."""
        problems, run_B = self.problems, self.run_B
        B = rec.get("B")
        if not _is_int(B) or B < 1:
            problems.add(step, f"B must be a positive integer, got {B!r}")
            return
        if run_B is not None and B != run_B:
            problems.add(step, f"B={B}, but the run's B is {run_B} (B must stay constant)")
        committed = rec.get("committed")
        if not _is_int(committed):
            problems.add(step, f"committed must be an integer, got {committed!r}")
        elif line_policy == "static" and committed != run_B:
            problems.add(step, f"committed={committed}, expected B={run_B}")
        elif line_policy == "adaptive" and not 0 < committed <= B:
            problems.add(step, f"committed={committed}, expected 1..B={B}")
        if "ids" in rec:
            _check_id_ranges(problems, step, rec["ids"], run_B or B, committed, line_policy)
        elif "microbatch_ids" in rec:
            _check_ids(problems, step, rec["microbatch_ids"], run_B or B, committed, line_policy)


def _compare_losses(
    problems: _Problems, losses: dict[int, Any], reference: str, rtol: float
) -> None:
    try:
        ref_records = read_ledger(reference, raw=True)
    except (OSError, LedgerFormatError) as exc:
        problems.add(None, f"cannot read reference ledger: {exc}")
        return
    ref = {r["step"]: r.get("loss") for r in ref_records if _is_int(r.get("step"))}
    only_here = sorted(set(losses) - set(ref))
    only_ref = sorted(set(ref) - set(losses))
    if only_here or only_ref:
        first = min(only_here[:1] + only_ref[:1])
        problems.add(
            first,
            f"step counts differ: ledger has {len(losses)} steps, reference has {len(ref)} "
            f"(steps only in the ledger: {_fmt_ids(only_here)}, "
            f"only in the reference: {_fmt_ids(only_ref)})",
        )
    differing: list[tuple[int, Any, Any]] = []
    for step in sorted(set(losses) & set(ref)):
        a, b = losses[step], ref[step]
        if not (_is_number(a) and _is_number(b)):
            if a != b:
                differing.append((step, a, b))
            continue
        if math.isnan(a) and math.isnan(b):
            continue  # both diverged identically
        if not math.isclose(a, b, rel_tol=rtol, abs_tol=1e-8):
            differing.append((step, a, b))
    if differing:
        step, a, b = differing[0]
        rel = (
            f" (rel diff {abs(a - b) / max(abs(b), 1e-30):.3g} > rtol {rtol:g})"
            if _is_number(a) and _is_number(b)
            else ""
        )
        problems.add(
            step,
            f"loss {a!r} differs from the reference {b!r}{rel}; "
            f"{len(differing)} of {len(set(losses) & set(ref))} compared steps differ",
        )


def main(argv: list[str] | None = None) -> int:
    """`lightning-recover check-ledger LEDGER [--reference REF] [--rtol X]`; 0 if OK, else 1."""
    parser = argparse.ArgumentParser(
        prog="lightning-recover check-ledger",
        description=(
            "Verify a step ledger: every StaticWorld step committed exactly its B microbatch "
            "ids once each, with constant B; optionally compare losses with a reference ledger."
        ),
    )
    parser.add_argument("ledger", help="the ledger (JSON lines) to check")
    parser.add_argument("--reference", help="a fault-free run's ledger to compare losses with")
    parser.add_argument(
        "--rtol", type=float, default=None,
        help="relative tolerance for losses (default: by the precision the ledger records: 1e-4 for fp32, 5e-3 for fp16, 1e-2 for bf16)",
    )
    parser.add_argument(
        "--policy",
        choices=("static", "adaptive"),
        default=None,
        help="override the ledger's policy key (default: per line, static if absent)",
    )
    args = parser.parse_args(argv)
    if args.rtol is not None and not args.rtol >= 0:
        parser.error(f"--rtol must be >= 0, got {args.rtol}")
    verdict = check_ledger(
        args.ledger, reference=args.reference, rtol=args.rtol, policy=args.policy
    )
    for text in verdict.problems[:_MAX_PRINTED_PROBLEMS]:
        print(text)
    if len(verdict.problems) > _MAX_PRINTED_PROBLEMS:
        print(f"... and {len(verdict.problems) - _MAX_PRINTED_PROBLEMS} more problems")
    print(verdict.summary_line())
    sys.stdout.flush()
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
