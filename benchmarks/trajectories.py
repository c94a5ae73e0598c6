"""Bitwise before/after trajectory check for a refactor of the recovery protocol (issue 24).

A refactor must leave every launched training run exactly where it was: the same committed
steps, microbatch ids, memberships, world epochs, losses and final parameters, fault-free and
faulted. This script records a fixed set of launched ``train_worker.py`` jobs from a checkout
and compares two such recordings bit for bit.

    python -m benchmarks.trajectories record OUT_DIR [--repo REPO]
    python -m benchmarks.trajectories compare A_DIR B_DIR

``record`` runs each configuration of :data:`CONFIGS` as a launched job from REPO (default:
this checkout) as the launched tests launch one: ``lightning-recover launch`` in REPO with
LR_TEST_OUT, OMP_NUM_THREADS=1 and REPO + REPO/benchmarks on PYTHONPATH (the worker,
``train_worker.py``, is found with a glob under REPO/tests, so a reorganised tests/ folder
still works). Each configuration
writes OUT_DIR/<config>/: ledger.jsonl, params{R}.pt, rank{R}.json (and launch{I}.log, the
job's output); OUT_DIR/RECORDED.json names the commit that was run.

``compare`` prints one line per configuration (``same`` or the first difference) and last
``N/N configurations bitwise equal``; it exits 1 on any difference. Ledgers are compared by
meaning, in the full form (every id, replica and role), so a recording of the compact line
format (issue 33) compares with one of the full format written before it.

Determinism (each configuration was recorded twice on ee0ea79 and compared with itself): every
fault is injected at a named step/rank/phase (the points the launched tests use), never at a
wall-clock time, so the ledgers and parameters are the same on every run. One configuration
was *fixed* to be deterministic: ``rejoin``. Left to the tests' ``--slow-while-degraded``, the
step at which the replacement is admitted depends on how fast it imports torch; here every
rank sleeps ``--slow-while-rejoining`` (25) seconds after each step while a re-join is open
or to come: the attempt spawns at the boundary after the sleep that follows the fault's step
(step 2), and the replacement (ready about 5 s after its spawn on 2 busy cores) is always
admitted at the next boundary (step 3). The hang configuration (SIGSTOP, evicted by the
launcher's watchdog) is deterministic in the ledger: the fault's step and replica are fixed,
only its detection time varies, and that field is dropped (see :data:`VOLATILE_KEYS`). No
configuration was replaced.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: Keys dropped (at any depth of a ledger line or a rank{R}.json) before comparing: only what
#: measures wall-clock time, so differs between two runs of the same code. Everything else
#: (losses, microbatch ids, epochs, memberships, roles, faults, sdc events, counters) must be
#: equal as JSON values, floats bit for bit.
VOLATILE_KEYS: dict[str, str] = {
    "step_time_s": "the step's wall-clock duration",
    "recovery_s": "wall-clock length of the step's recovery pause",
    "pauses_s": "wall-clock length of each recovery pause in the step",
    "detect_s": "wall-clock time from a fault to its detection (the hang watchdog's timeout plus scheduling)",
    "detects_s": "the same, per fault of the step",
    "transfer_s": "a re-joined replica's state transfer time (joins[])",
    "pause_s": "the survivors' wall-clock pause for a join (joins[])",
}
#: rank{R}.json keys that name a process (present only with --num-workers, which no
#: configuration uses; listed so a later configuration cannot compare pids by accident).
PROCESS_KEYS: dict[str, str] = {
    "pid": "the rank's operating-system process id",
    "dead_ranks_loaders": "pids of loader workers still running",
}


def kill(step: int, rank: int, phase: str = "backward", **extra: Any) -> dict[str, Any]:
    return {"step": step, "rank": rank, "phase": phase, "kind": "kill", **extra}


@dataclass(frozen=True)
class Launch:
    """One launched train_worker job of a configuration (a configuration may chain several)."""

    nprocs: int
    argv: list[str]
    faults: list[dict[str, Any]] = field(default_factory=list)
    #: The job's exit status: 0, or what a job that is meant to stop (min_replicas) exits with.
    expect_ok: bool = True
    #: The launcher's hang watchdog timeout (seconds), for the hang / gloo configurations.
    hang_timeout: float | None = None


#: Placeholder in argv for the configuration's own checkpoint folder (OUT_DIR/<config>/ckpt).
CKPT = "{ckpt}"

CONFIGS: dict[str, list[Launch]] = {
    # (1) 2 replicas x 2 shards, fault-free.
    "ff_2x2": [Launch(4, ["--steps", "4", "--shards", "2"])],
    # (2) 4x1: replica 1 SIGKILLed in step 1's backward.
    "kill_4x1": [Launch(4, ["--steps", "4"], [kill(1, 1)])],
    # (3) 2x2 over the gloo data plane: rank 2 dies in the middle of the reduce (after bucket 5).
    "gloo_kill_2x2": [Launch(4, ["--steps", "4", "--shards", "2", "--data-plane", "gloo"],
                             [kill(1, 2, "reduce", bucket=5)], hang_timeout=4)],
    # (4) The leader (rank 0) killed in backward, under the adaptive policy (the other policy
    # train_worker supports: the trajectory departs from the fault-free one by design).
    "leader_kill_adaptive_4x1": [Launch(4, ["--steps", "4", "--policy", "adaptive"], [kill(1, 0)])],
    # (5) 2x2: rank 2 SIGSTOPped in backward; the watchdog kills it, its mate leaves by the gate.
    "hang_2x2": [Launch(4, ["--steps", "4", "--shards", "2"],
                        [{"step": 1, "rank": 2, "phase": "backward", "kind": "hang"}], hang_timeout=4)],
    # (6) Static policy cascade: replica 1 dies in the reduce, replica 2 while the survivors
    # replay the boundary step's extra microbatches.
    "cascade_static_4x1": [Launch(4, ["--steps", "4"], [kill(1, 1, "reduce"), kill(1, 2, "forward", microbatch=2)])],
    # (7) The leader dies while writing the step-4 checkpoint; the new leader writes it again
    # (issue 34: before, it resumed from step 2), with min_replicas=4 the job stops; it resumes
    # from the step-4 checkpoint on 3 replicas.
    "ckpt_resume": [
        Launch(4, ["--steps", "6", "--ckpt-dir", CKPT, "--ckpt-every", "2", "--min-replicas", "4"],
               [kill(4, 0, "checkpoint")], expect_ok=False),
        Launch(3, ["--steps", "6", "--ckpt-dir", CKPT, "--ckpt-every", "2", "--resume"]),
    ],
    # (8) Hot re-join: replica 1 killed in step 1, a spawned replacement admitted before step 3
    # (made deterministic by --slow-while-rejoining, see the module docstring).
    "rejoin_2x1": [Launch(2, ["--steps", "5", "--rejoin", "--slow-while-rejoining", "25"], [kill(1, 1)])],
    # (9) Silent data corruption repaired: a spare's gradient bit flip caught by the cross-check
    # (recompute), then replica 2's parameters flipped and repaired in place by majority.
    "sdc_repair": [Launch(4, ["--steps", "8", "--target", "3", "--sdc-every", "1", "--sdc-action", "repair"], [
        {"step": 1, "rank": 3, "phase": "backward", "microbatch": 1, "kind": "corrupt", "target": "grads"},
        {"step": 3, "rank": 2, "phase": "optimizer", "kind": "corrupt", "target": "params"},
    ])],
}

#: Seconds before a single launch is killed: every configuration finishes in well under a
#: minute on 2 busy cores; a hung one must not stall the recording forever.
LAUNCH_TIMEOUT_S = 240.0


def _find_one(repo: Path, name: str) -> Path:
    hits = sorted(glob.glob(str(repo / "tests" / "**" / name), recursive=True))
    if not hits:
        raise SystemExit(f"trajectories: no {name} under {repo / 'tests'}; pass --repo a lightning-recover checkout")
    if len(hits) > 1:
        raise SystemExit(f"trajectories: several {name} under {repo / 'tests'}: {hits}; keep one")
    return Path(hits[0])


def _runner(repo: Path, worker: Path) -> Callable[[Launch, Path, list[str]], tuple[int, str]]:
    """A function launching one job from REPO as its launched tests do: REPO's own launcher and package."""
    rel_worker = str(worker.relative_to(repo))

    def run(launch: Launch, outdir: Path, argv: list[str]) -> tuple[int, str]:
        args = [rel_worker, *argv, "--faults", json.dumps(launch.faults)]
        # The launched tests' launch: the launcher with OUT and one thread; REPO first on the path
        # (``-m`` from cwd=REPO for the launcher, PYTHONPATH for the ranks), so REPO's package runs,
        # not the one installed; REPO/benchmarks too, where an older checkout's worker imports from it.
        cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(launch.nprocs)]
        if launch.hang_timeout is not None:
            cmd += ["--hang-timeout", str(launch.hang_timeout)]
        cmd += ["--", sys.executable, *args]
        env = dict(os.environ, LR_TEST_OUT=str(outdir), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(repo), str(repo / "benchmarks")]))
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM: the launcher forwards it to mpiexec's session; then reap what is left.
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
            raise SystemExit(f"trajectories: job timed out after {LAUNCH_TIMEOUT_S}s: {args}\n{stderr[-5000:]}")
        return proc.returncode, f"rc={proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"

    return run


def record(out_dir: Path, repo: Path, only: list[str] | None) -> None:
    repo = repo.resolve()
    worker = _find_one(repo, "train_worker.py")
    run = _runner(repo, worker)
    # The harness lets these environment variables change every job's planes; the baseline
    # is the defaults (mpi data plane, auto replica plane).
    for var in ("RECOVER_TEST_DATA_PLANE", "RECOVER_TEST_REPLICA_PLANE"):
        os.environ.pop(var, None)
    # Which code made the recording: compare prints nothing about it, a reader of OUT_DIR needs it.
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "RECORDED.json").write_text(json.dumps({"repo": str(repo), "commit": head, "uncommitted_changes": bool(dirty.strip())}) + "\n")
    names = only or list(CONFIGS)
    for name in names:
        if name not in CONFIGS:
            raise SystemExit(f"trajectories: unknown configuration {name!r}; choose from {sorted(CONFIGS)}")
        cdir = (out_dir / name).resolve()
        if cdir.exists() and any(cdir.iterdir()):
            raise SystemExit(f"trajectories: {cdir} is not empty; record into a fresh OUT_DIR")
        cdir.mkdir(parents=True, exist_ok=True)
        for i, launch in enumerate(CONFIGS[name]):
            argv = [a.replace(CKPT, str(cdir / "ckpt")) for a in launch.argv]
            rc, described = run(launch, cdir, argv)
            (cdir / f"launch{i}.log").write_text(described)
            if (rc == 0) != launch.expect_ok:
                raise SystemExit(f"trajectories: {name} launch {i} exited {rc} (expected {'0' if launch.expect_ok else 'non-zero'}); "
                                 f"see {cdir / f'launch{i}.log'}")
        print(f"{name}: recorded into {cdir}", flush=True)


def _strip(value: Any) -> Any:
    """``value`` without the VOLATILE_KEYS / PROCESS_KEYS, at any depth."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE_KEYS and k not in PROCESS_KEYS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _first_diff(a: Any, b: Any, where: str = "") -> str | None:
    """Where two JSON values first differ; floats compared by repr (bit for bit), bool != int."""
    if type(a) is not type(b):
        return f"{where}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(a.keys() ^ b.keys())} in one only"
        for k in a:
            d = _first_diff(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_diff(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float):
        return None if repr(a) == repr(b) else f"{where}: {a!r} vs {b!r}"
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def _tensor_diff(a: Any, b: Any, where: str) -> str | None:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    # The raw bytes: torch.equal on floats would call -0.0 == 0.0 and NaN != NaN.
    if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
        return f"{where}: values differ (max abs diff {(a.double() - b.double()).abs().max().item():.3e})"
    return None


#: Keys of the compact ledger line (issue 33) that only encode what the full line spells out.
COMPACT_KEYS = ("ids", "membership", "members", "died", "role_changes")


def _ledger_meaning(path: Path) -> list[Any]:
    """A ledger's lines in the full form, whichever format wrote them: every id, replica and role."""
    from lightning_recover.audit.ledger import microbatch_ids, read_ledger

    out = []
    for rec in read_ledger(path):
        full = {k: v for k, v in rec.items() if k not in COMPACT_KEYS}
        if "ids" in rec or "microbatch_ids" in rec:
            full["microbatch_ids"] = microbatch_ids(rec)
        out.append(_strip(full))
    return out


#: Ledger fields added after recordings were made: compared when both recordings have them,
#: dropped when one recording predates them (no line of it has the key).
ADDED_KEYS = {"precision": "the run's precision, which check-ledger fits its tolerance to (issue 34)"}


def _without_added_keys(a: list[Any], b: list[Any]) -> tuple[list[Any], list[Any]]:
    def has(lines: list[Any], key: str) -> bool:
        return any(isinstance(line, dict) and key in line for line in lines)

    drop = {k for k in ADDED_KEYS if has(a, k) != has(b, k)}
    if not drop:
        return a, b
    strip = lambda lines: [{k: v for k, v in line.items() if k not in drop} for line in lines]  # noqa: E731
    return strip(a), strip(b)


#: Keys of the full ledger line that the compact one encodes in COMPACT_KEYS.
FULL_KEYS = ("microbatch_ids", "replicas", "roles")


def _rank_result(path: Path) -> Any:
    """A rank{R}.json without what only one ledger format holds in its ``last`` record.

    ``last`` is the rank's copy of its last ledger line: alone, a compact one cannot be
    resolved (its membership may be written lines before), and the ledger, compared by
    meaning above, already holds that line."""
    result = _strip(json.loads(path.read_text()))
    last = result.get("last")
    if isinstance(last, dict):
        result["last"] = {k: v for k, v in last.items() if k not in COMPACT_KEYS and k not in FULL_KEYS and k not in ADDED_KEYS}
    return result


def compare_config(a: Path, b: Path) -> str | None:
    """The first difference between two recordings of one configuration, or None."""
    import torch

    la, lb = (p / "ledger.jsonl" for p in (a, b))
    for p in (la, lb):
        if not p.exists():
            return f"{p} missing"
    lines_a, lines_b = _without_added_keys(*(_ledger_meaning(p) for p in (la, lb)))
    d = _first_diff(lines_a, lines_b, "ledger")
    if d:
        return d
    for pattern, load in (("params*.pt", lambda f: torch.load(f, map_location="cpu")), ("rank*.json", lambda f: _rank_result(f))):
        names_a = sorted(f.name for f in a.glob(pattern))
        names_b = sorted(f.name for f in b.glob(pattern))
        if names_a != names_b:
            return f"{pattern}: {names_a} vs {names_b}"
        if not names_a:
            return f"no {pattern} in {a}"
        for n in names_a:
            x, y = load(a / n), load(b / n)
            if pattern.endswith(".pt"):
                if x.keys() != y.keys():
                    return f"{n}: keys {sorted(x.keys() ^ y.keys())} in one only"
                for k in x:
                    d = _tensor_diff(x[k], y[k], f"{n}[{k}]")
                    if d:
                        return d
            else:
                d = _first_diff(x, y, n)
                if d:
                    return d
    return None


def compare(a_dir: Path, b_dir: Path) -> int:
    names = sorted({p.name for d in (a_dir, b_dir) for p in d.iterdir() if p.is_dir()})
    if not names:
        raise SystemExit(f"trajectories: no configuration folders in {a_dir} or {b_dir}")
    same = 0
    for name in names:
        if not (a_dir / name).is_dir() or not (b_dir / name).is_dir():
            print(f"{name}: recorded in one directory only")
            continue
        d = compare_config(a_dir / name, b_dir / name)
        print(f"{name}: {'same' if d is None else d}")
        same += d is None
    print(f"{same}/{len(names)} configurations bitwise equal")
    return 0 if same == len(names) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run every configuration from REPO into OUT_DIR/<config>/")
    rec.add_argument("out_dir", type=Path)
    rec.add_argument("--repo", type=Path, default=HERE.parent, help="the checkout to run (default: this one)")
    rec.add_argument("--only", nargs="+", default=None, metavar="CONFIG", help=f"a subset of {list(CONFIGS)}")
    cmp = sub.add_parser("compare", help="compare two recordings bit for bit")
    cmp.add_argument("a_dir", type=Path)
    cmp.add_argument("b_dir", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.out_dir, args.repo, args.only)
        return 0
    return compare(args.a_dir, args.b_dir)


if __name__ == "__main__":
    sys.exit(main())
