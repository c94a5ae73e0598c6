"""The control plane at scale: MPI calls and bytes per rank, per steady step and per repair, at 4-64 ranks.

Run it as ``python -m benchmarks.control_plane`` (4 8 16 32 64 ranks; a few minutes on a
2-core machine) or ``--ranks 4 8 16`` (what ``tests/launched/test_control_plane.py`` runs).
For each N one job of ``benchmarks/control_plane_rank.py`` is launched with the project's
launcher (``python -m lightning_recover.cli launch -n N``: ``mpiexec --with-ft ulfm``,
``--oversubscribe`` past the cores) inside a :class:`proctree.ProcessTree` under a hard
timeout. Every rank runs the package's step engine over a real ``FaultTolerantComm`` with
its MPI calls counted (``mpi_counter.py``: calls and payload bytes per MPI operation, per
rank, per phase); one rank SIGKILLs itself in the middle of a step's reduction. All ranks
wait politely (``LIGHTNING_RECOVER_MPI_WAIT=sleep``), so every size issues the same
operations whatever the cores.

Printed, per N: the per-rank tally of one steady step (checked identical on every rank,
every steady step, and the step after the repair), of ``repair()``, of the whole faulty
step and of the communicator's start-up; then the fitted growth ``bytes ~ a * n^k`` of
each (least squares on log-log, ``benchmarks/scaling.py``'s fit), the repair's bytes fitted
against the n - 1 survivors it works on and per added rank (at most linear: that never
grows) and, last, the headline: steady-step calls and bytes per rank at the smallest and
largest N, and the exponents. The exit status is 1 when a size failed, the steady step's
tally differs between sizes, or the repair's bytes grow faster than linearly. Results go
to ``benchmarks/results/control_plane.json``.

The extrapolation to 100k ranks (ULFM's agreement and shrink as published) is
``benchmarks/control_plane_model.py``; docs/benchmarks.md has both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RANK = ROOT / "benchmarks" / "control_plane_rank.py"
from benchmarks.proctree import ProcessTree  # noqa: E402
from benchmarks.scaling import fit_power  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "control_plane.json"
#: Per-rank phases of a job, as control_plane_rank.py records them.
PHASES = ("steady", "repair", "faulty", "startup")

Tally = dict[str, list[int]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="world sizes (one launched job each)")
    p.add_argument("--steps", type=int, default=3, help="steady steps counted per job")
    p.add_argument("--timeout", type=float, default=None, help="hard timeout per job in seconds (default 90 + 6 s per rank)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON results file")
    p.add_argument("--workdir", type=Path, default=None, help="where the ranks write (default: a temporary folder)")
    p.add_argument("--lightning", action="store_true",
                   help="count a Lightning Trainer's steps under ReCoVerHSDPStrategy instead (no fault; e.g. --ranks 4 8)")
    p.add_argument("--sdc", action="store_true", help="with --lightning: the silent-data-corruption check after every step")
    args = p.parse_args(argv)
    if min(args.ranks) < 3:
        p.error("--ranks: every job needs at least 3 ranks (one is killed, two must survive)")
    if len(set(args.ranks)) < 2:
        p.error("--ranks: the growth fit needs at least two distinct world sizes")
    return args


def totals(tally: Tally) -> tuple[int, int, int]:
    """(calls, bytes sent, bytes received) of a tally, over its operations."""
    return (sum(v[0] for v in tally.values()), sum(v[1] for v in tally.values()), sum(v[2] for v in tally.values()))


def fmt(tally: Tally) -> str:
    return ", ".join(f"{name} {c}x {s}/{r} B" for name, (c, s, r) in sorted(tally.items()))


def run_job(n: int, args: argparse.Namespace, outdir: Path) -> dict[str, Any]:
    """Launch one N-rank job; its whole process tree is gone when this returns."""
    outdir.mkdir(parents=True, exist_ok=True)
    from lightning_recover.cli.mpiexec import launch_env

    timeout = args.timeout if args.timeout is not None else 90 + 6 * n
    cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(n), "--",
           sys.executable, str(RANK), "--out", str(outdir), "--steps", str(args.steps), *(["--lightning"] if args.lightning else []), *(["--sdc"] if args.sdc else [])]
    env = launch_env()
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "LIGHTNING_RECOVER_MPI_WAIT": "sleep",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    t0 = time.monotonic()
    with ProcessTree(cmd, f"control plane {n} ranks", cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as tree:
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.append(tree.proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()  # drain the pipe so the job never blocks on a full one
        rc = tree.wait(timeout)
        leftovers = tree.end()
        reader.join(timeout=10)
    log = b"".join(chunks).decode(errors="replace")
    (outdir / "job.log").write_text(log)
    return {"ranks": n, "rc": rc, "timed_out": rc is None, "wall_s": time.monotonic() - t0, "leftovers": leftovers,
            "log_tail": log[-3000:]}


def analyse(n: int, job: dict[str, Any], outdir: Path) -> dict[str, Any]:
    """One world size's point: the steady tally (identical everywhere, else an error), the repair's per rank."""
    rows = [json.loads(f.read_text()) for f in sorted(outdir.glob("rank*.json"))]
    if len(rows) != n - 1:
        raise RuntimeError(f"the {n}-rank job did not finish: {len(rows)} of {n - 1} survivors reported "
                           f"(rc={job['rc']}, timed out={job['timed_out']}); log tail:\n{job['log_tail']}")
    steady = rows[0]["steady"][0]
    odd = [(r["rank"], i) for r in rows for i, s in enumerate([*r["steady"], r["after"]]) if s != steady]
    if odd:
        raise RuntimeError(f"{n} ranks: the steady step's MPI calls differ between ranks or steps (rank, step): {odd}")
    bad = [r["rank"] for r in rows if r["fault_record"]["faults"] != [r["victim"]] or r["members_after"] != n - 1 or len(r["repairs"]) != 1]
    if bad:
        raise RuntimeError(f"{n} ranks: ranks {bad} did not see exactly one repair of the victim's loss")
    if len({r["param_sum"] for r in rows}) != 1:
        raise RuntimeError(f"{n} ranks: the survivors' parameters differ after the repair")

    def median_totals(phase: str) -> dict[str, float]:
        pick = {"steady": lambda r: r["steady"][0], "repair": lambda r: r["repairs"][0]}.get(phase, lambda r: r[phase])
        ts = [totals(pick(r)) for r in rows]
        return {k: statistics.median(t[i] for t in ts) for i, k in enumerate(("calls", "sent", "recv"))}

    return {
        "ranks": n,
        "buckets": rows[0]["buckets"],
        "steady_tally": steady,
        "repair_tally_leader": rows[0]["repairs"][0],
        "faulty_tally_leader": rows[0]["faulty"],
        "startup_tally_leader": rows[0]["startup"],
        "per_rank": {phase: median_totals(phase) for phase in PHASES},
        "wall_s": job["wall_s"],
        "leftovers": job["leftovers"],
    }


def fits(points: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Fitted exponent k of ``x ~ a * n^k`` per phase and quantity (calls, sent, recv bytes per rank)."""
    ns = [p["ranks"] for p in points]
    return {
        phase: {q: fit_power(ns, [max(p["per_rank"][phase][q], 1e-9) for p in points])[1] for q in ("calls", "sent", "recv")}
        for phase in PHASES
    }


def main_lightning(args: argparse.Namespace, base: Path) -> int:
    """``--lightning``: each size's steady steps under the Trainer, checked identical on every rank and size."""
    tallies: dict[int, Tally] = {}
    for n in args.ranks:
        outdir = base / f"n{n}"
        job = run_job(n, args, outdir)
        rows = [json.loads(f.read_text()) for f in sorted(outdir.glob("rank*.json"))]
        # A broadcast's root sends what the others receive: ranks are compared on calls and bytes moved (sent + received).
        steps = [{op: [c, sent + recv] for op, (c, sent, recv) in s.items()} for r in rows for s in r["steady"]]
        if len(rows) != n or not steps or any(s != steps[0] for s in steps):
            print(f"[control_plane] {n} ranks under Lightning: {len(rows)} of {n} ranks reported; steady tallies "
                  f"{sorted({json.dumps(s, sort_keys=True) for s in steps})}; log tail:\n{job['log_tail']}", flush=True)
            return 1
        tallies[n] = rows[0]["steady"][0]
        print(f"{n:>3} ranks under Lightning ({len(steps)} steady steps, {job['wall_s']:.0f} s; leader): {fmt(tallies[n])}", flush=True)
    constant = all(t == tallies[args.ranks[0]] for t in tallies.values())
    lo, hi = args.ranks[0], args.ranks[-1]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"what": "MPI calls per rank per steady step of a Lightning Trainer under ReCoVerHSDPStrategy",
                                    "steady": {str(n): t for n, t in tallies.items()}, "steady_constant": constant}, indent=2) + "\n")
    c_lo, s_lo, _ = totals(tallies[lo])
    c_hi, s_hi, _ = totals(tallies[hi])
    print(f"Lightning steady step per rank {lo} -> {hi} ranks: {c_lo} -> {c_hi} MPI calls, {s_lo} -> {s_hi} B sent "
          f"({'constant' if constant else 'NOT constant'})")
    return 0 if constant else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tempfile

    base = args.workdir or Path(tempfile.mkdtemp(prefix="control_plane_"))
    if args.lightning:
        if args.out == RESULTS:
            args.out = RESULTS.with_name("control_plane_lightning.json")
        return main_lightning(args, base)
    points: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for n in args.ranks:
        outdir = base / f"n{n}"
        job = run_job(n, args, outdir)
        try:
            pt = analyse(n, job, outdir)
        except RuntimeError as exc:
            print(f"[control_plane] {n} ranks: {exc}", flush=True)
            failed.append({"ranks": n, "error": str(exc)})
            continue
        points.append(pt)
        print(f"{n:>3} ranks ({pt['buckets']} buckets, {job['wall_s']:.0f} s):", flush=True)
        print(f"    steady step: {fmt(pt['steady_tally'])}")
        print(f"    repair():    {fmt(pt['repair_tally_leader'])}")
        print(f"    faulty step: {fmt(pt['faulty_tally_leader'])}")
        print(f"    start-up:    {fmt(pt['startup_tally_leader'])}")
    if len(points) < 2:
        print("control plane: fewer than two world sizes finished; nothing to fit")
        return 1
    print("\nper rank (median over survivors): calls / bytes sent / bytes received")
    print(f"{'ranks':>6} | " + " | ".join(f"{ph:^22}" for ph in PHASES))
    for pt in points:
        cells = [f"{pt['per_rank'][ph]['calls']:>4.0f} {pt['per_rank'][ph]['sent']:>7.0f} {pt['per_rank'][ph]['recv']:>8.0f}" for ph in PHASES]
        print(f"{pt['ranks']:>6} | " + " | ".join(cells))
    k = fits(points)
    print("\nfitted growth x ~ a * n^k (k per phase: calls, sent, recv)")
    for ph in PHASES:
        print(f"  {ph:<8} calls n^{k[ph]['calls']:.2f}   sent n^{k[ph]['sent']:.2f}   recv n^{k[ph]['recv']:.2f}")
    constant = all(pt["steady_tally"] == points[0]["steady_tally"] for pt in points)
    repair_bytes_k = max(k["repair"]["sent"], k["repair"]["recv"])
    # A repair works on the n - 1 survivors: its bytes fitted against them, and per added rank.
    ns = [p["ranks"] for p in points]
    repair_b = [p["per_rank"]["repair"]["sent"] + p["per_rank"]["repair"]["recv"] for p in points]
    k_survivors = fit_power([n - 1 for n in ns], [max(b, 1e-9) for b in repair_b])[1]
    marginal = [(b1 - b0) / (n1 - n0) for (n0, b0), (n1, b1) in zip(zip(ns, repair_b), zip(ns[1:], repair_b[1:]))]
    # At most linear: the bytes each added rank costs never grow (a superlinear term would make them).
    linear = all(m1 <= m0 * 1.05 + 1e-9 for m0, m1 in zip(marginal, marginal[1:]))
    print(f"  repair bytes (sent + received) per rank vs survivors n-1: n^{k_survivors:.2f}; per added rank: "
          + ", ".join(f"{m:.1f} B" for m in marginal) + f" ({'at most linear' if linear else 'SUPERLINEAR'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "MPI calls and payload bytes per rank (benchmarks/mpi_counter.py) per steady step, repair(), faulty step, start-up",
        "host": {"cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "args": {key: (str(v) if isinstance(v, Path) else v) for key, v in vars(args).items()},
        "points": points,
        "failed": failed,
        "fits": k,
        "repair_bytes_vs_survivors_k": k_survivors,
        "repair_bytes_per_added_rank": marginal,
        "repair_at_most_linear": linear,
        "steady_constant": constant,
    }, indent=2) + "\n")
    lo, hi = points[0], points[-1]
    c_lo, s_lo, _ = totals(lo["steady_tally"])
    c_hi, s_hi, _ = totals(hi["steady_tally"])
    print(f"steady step per rank {lo['ranks']} -> {hi['ranks']} ranks: {c_lo} -> {c_hi} MPI calls, {s_lo} -> {s_hi} B sent "
          f"({'constant' if constant else 'NOT constant'}, ratio {s_hi / s_lo:.2f}); repair bytes per rank ~ n^{repair_bytes_k:.2f} "
          f"(vs survivors ^{k_survivors:.2f}, {'at most linear' if linear else 'SUPERLINEAR'}), repair calls ~ n^{k['repair']['calls']:.2f}")
    return 1 if failed or not constant or not linear else 0


if __name__ == "__main__":
    sys.exit(main())
