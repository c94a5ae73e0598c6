"""Hot re-join, measured: what a join costs the survivors, and how long a replacement takes to arrive.

Run it as ``python -m benchmarks.rejoin`` (about 1-2 minutes on a 2-core machine). One
launched 4-rank job of ``benchmarks/bench_job.py`` (the example GPT, ReCoVer, 4 replicas x
1 shard, ``rejoin=True``): rank ``--victim`` is SIGKILLed in step ``--kill-step``, a
replacement is spawned while the survivors train, and it joins once it is ready. From the
job's step ledger it prints, per join:

* the survivors' blocked time (``pause_s``: the world's growth plus the state transfer;
  the spawn itself runs in a background thread and blocks nobody) and the state transfer's
  time (``transfer_s``), also in units of the median step;
* how long the replacement took to arrive (steps and seconds from the loss to its first
  step): on this 2-core machine it imports torch on cores the survivors use;
* the median step time with 4 replicas before the loss, with 3 while the replacement
  starts, and with 4 again after the join.

Results go to ``benchmarks/results/rejoin.json``; the last line printed is the headline
``re-join: survivors blocked 0.09 s per join (0.26 of a step), state transfer 0.08 s; ...``.

``python -m benchmarks.rejoin --salvage`` compares, in one run, the two ways a job with re-join
gets a broken replica back (issue 37): two 4-rank jobs, 2 replicas x 2 shards, rank
``--victim`` SIGKILLed in step ``--kill-step``. Without salvage the replica's live rank leaves
through the gate and a whole replica (2 processes) is spawned; with ``recover.salvage`` it
waits as an orphan and spawns only the missing rank (1 process). It prints, for each, the
processes spawned (the ledger's join record) and the time from the kill to capacity back (the
leader's "... s after the loss"); the last line is the ratio. Results go to
``benchmarks/results/salvage.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path
from benchmarks.common import launch, wait_quiet
from benchmarks.proctree import become_subreaper

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "rejoin.json"
SALVAGE_RESULTS = ROOT / "benchmarks" / "results" / "salvage.json"
#: The leader's line when a join is done, with the time since the loss.
CAPACITY_BACK = re.compile(r"replica\(s\) \[[0-9, ]+\] re-joined \(.*?; ([0-9.]+) s after the loss\)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120, help="max_steps (enough for the replacement to arrive)")
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--victim", type=int, default=3, help="original rank SIGKILLed")
    p.add_argument("--size", default="small")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", type=Path, default=None, help=f"results (default {RESULTS}, with --salvage {SALVAGE_RESULTS})")
    p.add_argument("--salvage", action="store_true", help="compare salvage's re-formed replica with a whole-replica re-join")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = SALVAGE_RESULTS if args.salvage else RESULTS
    return args


def summarize(ledger: list[dict], kill_step: int) -> dict:
    """Join costs and phase step times from a ledger (pure; tests call it)."""
    by_step = {d["step"]: d for d in ledger}
    steps = sorted(by_step)
    joins = [{**j, "step": s} for s in steps for j in by_step[s].get("joins", [])]
    lost_at = next((s for s in steps if by_step[s]["faults"]), None)
    first_join = joins[0]["step"] if joins else None
    t = [by_step[s]["step_time_s"] for s in steps]
    before = [by_step[s]["step_time_s"] for s in steps if s < (lost_at if lost_at is not None else len(steps))]
    degraded = [by_step[s]["step_time_s"] for s in steps if lost_at is not None and lost_at < s < (first_join or 10**9)]
    after = [by_step[s]["step_time_s"] for s in steps if first_join is not None and s > first_join]
    med = statistics.median(t) if t else float("nan")
    out = {
        "steps": len(steps), "lost_at_step": lost_at, "joins": joins, "median_step_s": med,
        "step_s_before": statistics.median(before) if before else None,
        "step_s_degraded": statistics.median(degraded) if degraded else None,
        "step_s_after_join": statistics.median(after) if after else None,
    }
    if joins and lost_at is not None:
        out["arrival_steps"] = first_join - lost_at
        out["arrival_s"] = sum(by_step[s]["step_time_s"] for s in steps if lost_at <= s < first_join)
        out["pause_median_s"] = statistics.median(j["pause_s"] for j in joins)
        out["transfer_median_s"] = statistics.median(j["transfer_s"] for j in joins)
    return out


def salvage_versus_whole(args: argparse.Namespace) -> int:
    """Two 2 x 2 jobs with re-join, side by side: the whole replica spawned again, and salvage's orphan plus
    its one spawned rank (module docstring)."""
    faults = [{"step": args.kill_step, "rank": args.victim, "phase": "backward", "kind": "kill"}]
    base = ["--system", "recover", "--rejoin", "--shards", "2", "--grad-accum", str(args.grad_accum), "--mbs", str(args.mbs),
            "--steps", str(args.steps), "--size", args.size, "--faults", json.dumps(faults)]
    print(f"salvage: 2 replicas x 2 shards with re-join, {args.steps} steps, rank {args.victim} killed in step {args.kill_step}",
          flush=True)
    rows: dict[str, dict] = {}
    for name, extra in (("whole replica", []), ("salvage", ["--salvage"])):
        work = Path(tempfile.mkdtemp(prefix="lr-salvage-"))
        wait_quiet(5.0)
        res = launch([*base, *extra], work, args.timeout)
        ledger = [json.loads(line) for line in (work / "ledger.jsonl").read_text().splitlines()] if (work / "ledger.jsonl").exists() else []
        back = CAPACITY_BACK.search((work / "job.log").read_text(errors="replace"))
        joins = [j for line in ledger for j in line.get("joins", [])]
        rows[name] = {"rc": res["rc"], "steps": len(ledger), "capacity_back_s": float(back.group(1)) if back else None,
                      "spawned": joins[0].get("spawned") if joins else None, "pause_s": joins[0]["pause_s"] if joins else None,
                      "transfer_s": joins[0]["transfer_s"] if joins else None, "work": str(work)}
        r = rows[name]
        if r["rc"] != 0 or r["steps"] != args.steps or r["capacity_back_s"] is None:
            print(res["log_tail"][-3000:], file=sys.stderr)
            print(f"salvage: the {name} run failed (exit {r['rc']}, {r['steps']}/{args.steps} steps, capacity back: "
                  f"{r['capacity_back_s']}); its log is above")
            return 1
        print(f"  {name:>13}: {r['spawned']} process(es) spawned, capacity back {r['capacity_back_s']:.2f} s after the kill, "
              f"survivors blocked {r['pause_s']:.3f} s, state transfer {r['transfer_s']:.3f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "salvage", "config": {k: str(v) for k, v in vars(args).items()}, **rows}, indent=1))
    print(f"wrote {args.out}")
    whole, salvaged = rows["whole replica"], rows["salvage"]
    print(f"salvage: capacity back {salvaged['capacity_back_s']:.2f} s after the kill with {salvaged['spawned']} process spawned, "
          f"whole-replica re-join {whole['capacity_back_s']:.2f} s with {whole['spawned']}: "
          f"{whole['capacity_back_s'] / salvaged['capacity_back_s']:.2f}x faster")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.salvage:
        return salvage_versus_whole(args)
    work = Path(tempfile.mkdtemp(prefix="lr-rejoin-"))
    faults = [{"step": args.kill_step, "rank": args.victim, "phase": "backward", "kind": "kill"}]
    job = ["--system", "recover", "--rejoin", "--shards", "1", "--grad-accum", str(args.grad_accum), "--mbs", str(args.mbs),
           "--steps", str(args.steps), "--size", args.size, "--faults", json.dumps(faults)]
    print(f"rejoin: 4 replicas x 1 shard, {args.steps} steps, rank {args.victim} killed in step {args.kill_step} (work dir {work})",
          flush=True)
    wait_quiet(5.0)
    res = launch(job, work, args.timeout)
    ledger = [json.loads(line) for line in (work / "ledger.jsonl").read_text().splitlines()] if (work / "ledger.jsonl").exists() else []
    s = summarize(ledger, args.kill_step)
    ok = res["rc"] == 0 and s["steps"] == args.steps and bool(s["joins"])
    if not ok:
        print(res["log_tail"][-2000:], file=sys.stderr)
    for j in s["joins"]:
        print(f"  join of replica {j['replica']} before step {j['step']}: survivors blocked {j['pause_s']:.3f} s "
              f"({j['pause_s'] / s['median_step_s']:.2f} of a step), state transfer {j['transfer_s']:.3f} s, "
              f"committed its first step: {j.get('ok')}")
    fmt = lambda v: f"{v:.3f} s" if v is not None else "-"  # noqa: E731
    print(f"median step: {fmt(s['step_s_before'])} with 4 replicas, {fmt(s['step_s_degraded'])} with 3 while the replacement "
          f"starts, {fmt(s['step_s_after_join'])} with 4 again; job wall {res['wall_s']:.1f} s, other work "
          f"{res['foreign_cores'] if res['foreign_cores'] is not None else float('nan'):.2f} cores")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "rejoin", "config": {k: str(v) for k, v in vars(args).items()}, "ok": ok,
                                    "wall_s": res["wall_s"], "foreign_cores": res["foreign_cores"], **s}, indent=1, default=str))
    print(f"wrote {args.out}")
    if not s["joins"]:
        print("re-join: no join happened (the replacement did not arrive before the run ended; raise --steps)")
        return 1
    print(f"re-join: survivors blocked {s['pause_median_s']:.3f} s per join ({s['pause_median_s'] / s['median_step_s']:.2f} "
          f"of a step), state transfer {s['transfer_median_s']:.3f} s; the replacement arrived {s['arrival_steps']} steps "
          f"({s['arrival_s']:.1f} s) after the loss")
    return 0 if ok else 1


if __name__ == "__main__":
    become_subreaper()  # a launch's orphans re-parent to us, so its cleanup still finds them
    sys.exit(main())
