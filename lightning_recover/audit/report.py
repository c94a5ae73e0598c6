"""Recovery metrics of a finished run, read from its step ledger: `lightning-recover report`.

The ledger (see :mod:`lightning_recover.audit.ledger`) proves a run was exact; this module says what
recovery cost it, in the measures the fault-tolerance literature reports: MTTR (the pause per
recovery and the time to detect a failure), the observed MTBF, the replay ratio (microbatches
computed again because their replica died, over the microbatches committed), the success rate
and cost of replica joins, and the effective throughput with the fraction of time not paused.

Time is the ledger's time: the sum of ``step_time_s``, i.e. the time inside optimizer steps
(what happens between steps, such as validation or checkpoint writes, is not in the ledger).
A fault's pause (``recovery_s``, per recovery in ``pauses_s``) lies inside its step's
``step_time_s``; so does a join's survivors' pause (``pause_s`` of an entry of the optional
``joins`` field), as a join enters at a step boundary and that step's record carries it.

Pure Python (no torch, no MPI); matplotlib is imported only by :func:`plot_report`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_recover.audit.ledger import LedgerFormatError, read_ledger
from lightning_recover.errors import RecoverError

__all__ = [
    "REPORT_FIELDS",
    "Join",
    "ReportError",
    "RunReport",
    "load_ledger",
    "main",
    "plot_report",
    "report_from_path",
    "summarize",
]

#: The ledger fields a report needs on every line (all written by every LedgerWriter).
REPORT_FIELDS: tuple[str, ...] = (
    "step",
    "B",
    "committed",
    "replicas",
    "faults",
    "extra_microbatches",
    "step_time_s",
    "recovery_s",
)

_PLOTS_HINT = "pip install lightning-recover[plots]"


class ReportError(RecoverError, ValueError):
    """A ledger that cannot be reported on; the message names the bad value and the fix."""


@dataclass(frozen=True)
class Join:
    """One attempt of a replacement replica to join, as the optional ``joins`` field records it.

    ``transfer_s``: the live-state transfer to the joiner; ``pause_s``: the survivors' blocked
    time; ``ok``: the joiner entered training (False: the attempt failed and was given up).
    """

    step: int
    replica: int
    transfer_s: float
    pause_s: float
    ok: bool


@dataclass(frozen=True)
class RunReport:
    """The recovery metrics of one ledger. ``None`` where a metric has nothing to measure."""

    steps: int
    first_step: int
    last_step: int
    B: int
    policy: str
    #: Seconds of the ledger: the sum of step_time_s.
    wall_s: float
    committed_microbatches: int
    replayed_microbatches: int
    #: replayed / committed microbatches.
    replay_ratio: float
    replicas_start: int
    replicas_min: int
    replicas_end: int
    #: Replicas lost (entries of the records' `faults`), and the steps that lost any.
    faults: int
    faulted_steps: int
    #: Recoveries (entries of `pauses_s`) and their pauses: MTTR is the mean pause.
    recoveries: int
    paused_s: float
    mttr_s: float | None
    pause_max_s: float | None
    pause_per_fault_s: float | None
    #: Failed reduction rounds (entries of `detects_s`): the time blocked before a failure surfaced.
    detections: int
    detect_mean_s: float | None
    detect_max_s: float | None
    #: Ledger seconds per lost replica (the observed MTBF), and the mean time between the
    #: starts of consecutive faulted steps.
    mtbf_s: float | None
    fault_gap_mean_s: float | None
    join_attempts: int
    joins_ok: int
    join_success_rate: float | None
    #: Mean state-transfer time of the successful joins; mean survivors' pause over all attempts.
    join_transfer_mean_s: float | None
    join_pause_mean_s: float | None
    join_paused_s: float
    #: Committed microbatches (and samples, with a microbatch size) per ledger second.
    microbatches_per_s: float | None
    samples_per_s: float | None
    microbatch_size: int | None
    #: 1 - (fault pauses + join pauses) / wall_s, clipped to [0, 1]. Detection is not counted:
    #: a failed round's time includes the reduce a fault-free step spends too.
    unpaused_fraction: float | None
    #: Median step time of the steps without faults or joins (the undisturbed step).
    steady_step_time_s: float | None
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready metrics (what ``--json`` prints)."""
        d = asdict(self)
        d["warnings"] = list(self.warnings)
        return d

    def render(self, source: str | None = None) -> str:
        """The human-readable report (what ``lightning-recover report`` prints)."""
        name = f"ledger {source}: " if source else ""
        head = (f"{name}{self.steps} steps ({self.first_step}..{self.last_step}), B={self.B}, "
                f"policy {self.policy}, {_s(self.wall_s)} in steps")
        rows = [_row(label, text) for label, text in self._rows()]
        return "\n".join([head, *rows, *(f"warning: {w}" for w in self.warnings)])

    def _rows(self) -> list[tuple[str, str]]:
        """The report's rows, (label, text), in the order printed."""
        rows = [
            ("replicas", f"{self.replicas_start} at start, {self.replicas_min} at least, {self.replicas_end} at end"),
            ("faults", "none" if self.faults == 0 and self.recoveries == 0 else
             f"{_n(self.faults, 'replica')} lost in {_n(self.faulted_steps, 'step')}"),
            ("MTTR", self._mttr_text()),
            ("detection", "no failed rounds" if self.detect_mean_s is None else
             f"{_s(self.detect_mean_s)} mean per failed round ({_n(self.detections, 'round')}, max {_s(self.detect_max_s)})"),
            ("MTBF", self._mtbf_text()),
            ("replay ratio", f"{self.replay_ratio:.4f} ({self.replayed_microbatches} replayed of "
                             f"{self.committed_microbatches} committed microbatches)"),
            ("joins", self._joins_text()),
            ("throughput", self._throughput_text()),
        ]
        if self.steady_step_time_s is not None:
            rows.append(("steady step", f"{_s(self.steady_step_time_s)} median without faults or joins"))
        return rows

    def _mttr_text(self) -> str:
        if self.mttr_s is None:
            return "no recoveries"
        per_fault = f"; {_s(self.pause_per_fault_s)} per lost replica" if self.pause_per_fault_s is not None else ""
        return (f"{_s(self.mttr_s)} mean pause per recovery ({_n(self.recoveries, 'recovery', 'recoveries')}, "
                f"max {_s(self.pause_max_s)}, {_s(self.paused_s)} in all{per_fault})")

    def _mtbf_text(self) -> str:
        if self.mtbf_s is None:
            return f"no faults in {_s(self.wall_s)}"
        gap = f"; {_s(self.fault_gap_mean_s)} mean between faulted steps" if self.fault_gap_mean_s is not None else ""
        return f"{_s(self.mtbf_s)} per lost replica{gap}"

    def _joins_text(self) -> str:
        if self.join_attempts == 0:
            return "no joins"
        transfer = f", {_s(self.join_transfer_mean_s)} mean state transfer" if self.join_transfer_mean_s is not None else ""
        return (f"{self.joins_ok} of {self.join_attempts} succeeded ({self.join_success_rate:.0%}){transfer}, "
                f"{_s(self.join_pause_mean_s)} mean survivors' pause")

    def _throughput_text(self) -> str:
        if self.microbatches_per_s is None:
            return "no step time recorded"
        samples = (f" ({self.samples_per_s:.4g} samples/s at {self.microbatch_size} per microbatch)"
                   if self.samples_per_s is not None else "")
        return f"{self.microbatches_per_s:.4g} microbatches/s{samples}; {self.unpaused_fraction:.1%} of the time not paused"


def _n(count: int, noun: str, plural: str | None = None) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {plural or noun + 's'}"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def _row(label: str, text: str) -> str:
    return f"  {label:<13} {text}"


# --------------------------------------------------------------------------- reading


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _is_text(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def load_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ledger file, or a :class:`ReportError` saying why it is not one."""
    name = os.fspath(path)
    p = Path(path)
    if not p.exists():
        raise ReportError(
            f"no ledger at {name!r}: the file does not exist; pass the file the run wrote "
            f"(the strategy's ledger_path, recover.ledger_path in the example)"
        )
    if p.is_dir():
        raise ReportError(f"{name!r} is a directory; pass the ledger file in it (e.g. {name}/ledger.jsonl)")
    try:
        records = read_ledger(p)
    except LedgerFormatError as exc:
        if not _is_text(p):  # read_ledger takes undecodable bytes for a torn line: say what the file is
            raise ReportError(
                f"{name!r} is not text, so not a step ledger (JSON lines); pass the ledger_path the run wrote"
            ) from None
        raise ReportError(f"{exc}; `report` reads a lightning-recover step ledger") from None
    except OSError as exc:
        raise ReportError(f"cannot read the ledger {name!r} ({exc.strerror}); check its permissions") from None
    if not records:
        raise ReportError(
            f"ledger {name!r} has no steps: the run committed none; pass the ledger of a run that "
            f"committed at least one step"
        )
    return records


def _joins_of(rec: Mapping[str, Any], where: str) -> list[Join]:
    raw = rec.get("joins")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ReportError(f"{where}: joins must be a list of {{replica, transfer_s, pause_s, ok}}, got {raw!r}")
    joins = []
    for j, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            raise ReportError(f"{where}: joins[{j}] must be an object {{replica, transfer_s, pause_s, ok}}, got {entry!r}")
        replica, ok = entry.get("replica"), entry.get("ok")
        transfer, pause = entry.get("transfer_s", 0.0), entry.get("pause_s", 0.0)
        if not _is_int(replica) or replica < 0:
            raise ReportError(f"{where}: joins[{j}].replica must be a replica index >= 0, got {replica!r}")
        if not isinstance(ok, bool):
            raise ReportError(f"{where}: joins[{j}].ok must be true or false, got {ok!r}")
        for key, v in (("transfer_s", transfer), ("pause_s", pause)):
            if not _is_seconds(v):
                raise ReportError(f"{where}: joins[{j}].{key} must be seconds >= 0, got {v!r}")
        joins.append(Join(step=rec["step"], replica=replica, transfer_s=float(transfer), pause_s=float(pause), ok=ok))
    return joins


def _seconds_list(rec: Mapping[str, Any], key: str, where: str) -> list[float] | None:
    v = rec.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(_is_seconds(x) for x in v):
        raise ReportError(f"{where}: {key} must be a list of seconds >= 0, got {v!r}")
    return [float(x) for x in v]


def _validate(rec: Mapping[str, Any], n: int) -> None:
    step = rec.get("step")
    where = f"record {n}" + (f" (step {step})" if _is_int(step) else "")
    missing = [k for k in REPORT_FIELDS if k not in rec]
    if missing:
        raise ReportError(
            f"{where} lacks {missing}: not a lightning-recover step ledger; pass the "
            f"ledger_path the run wrote"
        )
    if not _is_int(step) or step < 0:
        raise ReportError(f"{where}: step must be an integer >= 0, got {step!r}")
    for key in ("B", "committed", "extra_microbatches"):
        if not _is_int(rec[key]) or rec[key] < 0:
            raise ReportError(f"{where}: {key} must be an integer >= 0, got {rec[key]!r}")
    for key in ("replicas", "faults"):
        if not isinstance(rec[key], list):
            raise ReportError(f"{where}: {key} must be a list of replica indices, got {rec[key]!r}")
    for key in ("step_time_s", "recovery_s"):
        if not _is_seconds(rec[key]):
            raise ReportError(f"{where}: {key} must be seconds >= 0, got {rec[key]!r}")


# --------------------------------------------------------------------------- metrics


def _mean(xs: Sequence[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


@dataclass
class _Totals:
    """What one pass over the sorted records collects for :func:`summarize`."""

    times: list[float]
    committed: int
    replayed: int
    live: list[int]
    pauses: list[float] = field(default_factory=list)
    detects: list[float] = field(default_factory=list)
    #: Ledger time at the start of each faulted step.
    fault_starts: list[float] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)
    faults: int = 0
    #: Step times of the steps without faults or joins.
    undisturbed: list[float] = field(default_factory=list)


def _totals(recs: Sequence[Mapping[str, Any]]) -> _Totals:
    times = [float(r["step_time_s"]) for r in recs]
    out = _Totals(times, sum(r["committed"] for r in recs), sum(r["extra_microbatches"] for r in recs),
                  [len(r["replicas"]) for r in recs])
    elapsed = 0.0
    for rec, t in zip(recs, times):
        where = f"step {rec['step']}"
        listed = _seconds_list(rec, "pauses_s", where)
        # Ledgers from before pauses_s carry the step's pause in recovery_s only.
        step_pauses = listed if listed is not None else ([float(rec["recovery_s"])] if rec["recovery_s"] > 0 else [])
        out.pauses += step_pauses
        listed = _seconds_list(rec, "detects_s", where)
        if listed is None and _is_seconds(rec.get("detect_s")) and rec["detect_s"] > 0:
            listed = [float(rec["detect_s"])]
        out.detects += listed or []
        step_joins = _joins_of(rec, where)
        out.joins += step_joins
        if rec["faults"]:
            out.faults += len(rec["faults"])
            out.fault_starts.append(elapsed)
        elif not step_pauses and not step_joins:
            out.undisturbed.append(t)
        elapsed += t
    return out


def _order_warnings(steps: Sequence[int]) -> list[str]:
    """Steps twice or missing (the report still counts what is there; check-ledger says more)."""
    warnings = []
    dups = sorted(s for s, c in Counter(steps).items() if c > 1)
    holes = [b for a, b in zip(steps, steps[1:]) if b > a + 1]
    if dups:
        warnings.append(f"steps {dups[:10]} appear more than once; their metrics count twice (run check-ledger)")
    if holes:
        warnings.append(f"steps are missing before step(s) {holes[:10]} (run check-ledger)")
    return warnings


def _unpaused_fraction(wall: float, paused: float, warnings: list[str]) -> float | None:
    """1 - paused / wall, clipped at 0 (a warning when the pauses exceed the time); None without time."""
    if wall <= 0:
        return None
    unpaused = 1.0 - paused / wall
    # Sums of the same floats in another order differ in the last bits: equal is not "exceeds".
    if unpaused < -1e-9:
        warnings.append(f"the pauses ({paused:.3f} s) exceed the step time ({wall:.3f} s); the ledger's times are inconsistent")
    return max(unpaused, 0.0)


def summarize(records: Sequence[Mapping[str, Any]], microbatch_size: int | None = None) -> RunReport:
    """The recovery metrics of a run's ledger records (in any order; they are sorted by step).

    ``microbatch_size`` (samples per microbatch) adds samples per second to the throughput.
    Raises :class:`ReportError` for no records or a record that is not a ledger line.
    """
    if not records:
        raise ReportError("no ledger records to report on; pass the ledger of a run that committed a step")
    if microbatch_size is not None and (not _is_int(microbatch_size) or microbatch_size < 1):
        raise ReportError(f"microbatch_size must be a positive integer, got {microbatch_size!r}")
    for n, rec in enumerate(records, 1):
        _validate(rec, n)
    # Sorted by step (stable), so the metrics do not depend on the order of the lines.
    recs = sorted(records, key=lambda r: r["step"])
    steps = [r["step"] for r in recs]
    warnings = _order_warnings(steps)
    t = _totals(recs)
    wall, paused = math.fsum(t.times), math.fsum(t.pauses)
    join_paused = math.fsum(j.pause_s for j in t.joins)
    ok_joins = [j for j in t.joins if j.ok]
    unpaused = _unpaused_fraction(wall, paused + join_paused, warnings)
    if t.replayed > t.committed:
        warnings.append(f"{t.replayed} replayed microbatches exceed the {t.committed} committed (run check-ledger)")
    return RunReport(
        steps=len(recs), first_step=steps[0], last_step=steps[-1],
        B=Counter(r["B"] for r in recs).most_common(1)[0][0],
        policy="/".join(sorted({str(r.get("policy", "static")) for r in recs})),
        wall_s=wall,
        committed_microbatches=t.committed, replayed_microbatches=t.replayed,
        replay_ratio=t.replayed / t.committed if t.committed else 0.0,
        replicas_start=t.live[0], replicas_min=min(t.live), replicas_end=t.live[-1],
        faults=t.faults, faulted_steps=len(t.fault_starts),
        recoveries=len(t.pauses), paused_s=paused, mttr_s=_mean(t.pauses),
        pause_max_s=max(t.pauses) if t.pauses else None,
        pause_per_fault_s=paused / t.faults if t.faults else None,
        detections=len(t.detects), detect_mean_s=_mean(t.detects), detect_max_s=max(t.detects) if t.detects else None,
        mtbf_s=wall / t.faults if t.faults else None,
        fault_gap_mean_s=_mean([b - a for a, b in zip(t.fault_starts, t.fault_starts[1:])]),
        join_attempts=len(t.joins), joins_ok=len(ok_joins),
        join_success_rate=len(ok_joins) / len(t.joins) if t.joins else None,
        join_transfer_mean_s=_mean([j.transfer_s for j in ok_joins]),
        join_pause_mean_s=_mean([j.pause_s for j in t.joins]), join_paused_s=join_paused,
        microbatches_per_s=t.committed / wall if wall > 0 else None,
        samples_per_s=t.committed * microbatch_size / wall if wall > 0 and microbatch_size else None,
        microbatch_size=microbatch_size, unpaused_fraction=unpaused,
        steady_step_time_s=statistics.median(t.undisturbed) if t.undisturbed else None,
        warnings=tuple(warnings),
    )


def report_from_path(path: str | os.PathLike[str], microbatch_size: int | None = None) -> RunReport:
    """:func:`summarize` of the ledger file at ``path``."""
    return _summarize_file(path, load_ledger(path), microbatch_size)


def _summarize_file(
    path: str | os.PathLike[str], records: Sequence[Mapping[str, Any]], microbatch_size: int | None
) -> RunReport:
    try:
        return summarize(records, microbatch_size)
    except ReportError as exc:
        raise ReportError(f"{os.fspath(path)}: {exc}") from None


# --------------------------------------------------------------------------- figure


def plot_report(records: Sequence[Mapping[str, Any]], out: str | os.PathLike[str], title: str | None = None) -> Path:
    """Draw live replicas and step time over the steps, faults and joins marked, as a PNG at ``out``."""
    try:
        # The object API, not pyplot: no backend switch, no global figure registry to leak into.
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ReportError(f"--plot needs matplotlib, which is not installed; run: {_PLOTS_HINT}") from None

    summarize(records)  # the same validation as the text report, before drawing anything
    recs = sorted(records, key=lambda r: r["step"])
    steps = [r["step"] for r in recs]
    live = [len(r["replicas"]) for r in recs]
    times = [float(r["step_time_s"]) for r in recs]
    fault_idx = [i for i, r in enumerate(recs) if r["faults"]]
    joins = [(i, j) for i, r in enumerate(recs) for j in _joins_of(r, f"step {r['step']}")]

    fig = Figure(figsize=(8, 5.5))
    ax_live, ax_time = fig.subplots(2, 1, sharex=True)
    ax_live.step(steps, live, where="mid", color="tab:blue", label="live replicas")
    ax_time.plot(steps, times, color="tab:gray", marker=".", label="step time")
    for ax in (ax_live, ax_time):
        for i in fault_idx:
            ax.axvline(steps[i], color="tab:red", alpha=0.25, linewidth=1)
    if fault_idx:
        ax_live.scatter([steps[i] for i in fault_idx], [live[i] for i in fault_idx], marker="x",
                        color="tab:red", zorder=3, label="fault")
        ax_time.scatter([steps[i] for i in fault_idx], [times[i] for i in fault_idx], marker="x",
                        color="tab:red", zorder=3, label="faulted step")
    for ok, marker, label in ((True, "^", "join"), (False, "v", "failed join")):
        at = [i for i, j in joins if j.ok is ok]
        # A failed attempt is hollow, so a success at the same step still shows through it.
        style = {"marker": marker, "zorder": 3, "edgecolors": "tab:green" if ok else "tab:orange",
                 "facecolors": "tab:green" if ok else "none"}
        if at:
            ax_live.scatter([steps[i] for i in at], [live[i] for i in at], label=label, **style)
            ax_time.scatter([steps[i] for i in at], [times[i] for i in at], **style)
    ax_live.set_ylabel("live replicas")
    ax_live.set_ylim(0, max(live) + 1)
    ax_live.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_time.set_ylabel("step time (s)")
    ax_time.set_xlabel("step")
    ax_time.set_ylim(bottom=0)
    ax_live.legend(loc="best", fontsize="small")
    ax_time.legend(loc="best", fontsize="small")
    if title:
        ax_live.set_title(title, fontsize="medium")
    fig.tight_layout()
    path = Path(out)
    try:
        fig.savefig(path, dpi=120, format="png")
    except OSError as exc:
        raise ReportError(f"cannot write the figure {os.fspath(out)!r} ({exc.strerror}); pass a writable --plot path") from None
    return path


# --------------------------------------------------------------------------- command


def main(argv: list[str] | None = None) -> int:
    """`lightning-recover report LEDGER [--json] [--plot FILE] [--microbatch-size N]`; 0 if reported, 2 if not."""
    parser = argparse.ArgumentParser(
        prog="lightning-recover report",
        description=(
            "Recovery metrics of a run from its step ledger: MTTR (pause per recovery, detection "
            "time), observed MTBF, replay ratio, join success rate and cost, effective throughput."
        ),
    )
    parser.add_argument("ledger", help="the run's step ledger (JSON lines)")
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    parser.add_argument("--plot", metavar="FILE", help=f"also draw a PNG figure (needs: {_PLOTS_HINT})")
    parser.add_argument(
        "--microbatch-size", type=int, default=None, metavar="N",
        help="samples per microbatch (the DataLoader's batch_size), to report samples/s too",
    )
    args = parser.parse_args(argv)
    if args.microbatch_size is not None and args.microbatch_size < 1:
        parser.error(f"--microbatch-size must be a positive integer, got {args.microbatch_size}")
    try:
        records = load_ledger(args.ledger)
        report = _summarize_file(args.ledger, records, args.microbatch_size)
        if args.plot:
            plot_report(records, args.plot, title=os.fspath(args.ledger))
    except ReportError as exc:
        print(f"lightning-recover report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.render(args.ledger))
        if args.plot:
            print(f"  {'figure':<13} {args.plot}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
