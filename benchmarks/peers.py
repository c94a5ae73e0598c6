"""ReCoVer side by side with torchft (and Lightning checkpoint-restart) under the same SIGKILLs.

Run it as ``python -m benchmarks.peers --steps 400`` (torchft from the ``peers`` extra:
``pip install -e ".[peers]"`` with your torch already installed; about 10 minutes on a
2-core machine). ``--quick`` is the CI smoke run (a few steps, ours and torchft if present).

Every system trains the example GPT (``examples/model.py``, ``--size``, default ``tiny``) on
the same byte corpus, with microbatches of ``--mbs`` sequences and a global batch of
B = 4 x G microbatches (4 replicas x 1 rank, AdamW, the same seed and initial weights),
for ``--steps`` committed optimizer steps, and loses the same replicas at the same steps:

* ``recover`` / ``recover-rejoin``: ReCoVerHSDPStrategy in one ``lightning-recover launch``
  job (``benchmarks/bench_job.py --system recover``), without and with hot re-join; with
  re-join the leader keeps ``--standbys`` warm standbys (``recover.rejoin.standbys``,
  default 2: one per planned kill); ``recover-rejoin-cold`` spawns the replacements cold
  after each loss (no standbys), as re-join did before standbys existed.
* ``torchft`` / ``torchft-<ms>``: torchft as its README and ``train_ddp.py`` run it: the Rust
  ``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``
  (``--heartbeat_timeout_ms``: its default 5000 with ProcessGroupGloo(5 s); and for
  ``torchft-low`` ``--torchft-heartbeat-ms``, default 1000, with ``--torchft-low-pg-timeout``,
  default 1 s: a survivor blocked in an all-reduce with the dead group waits for the gloo
  timeout whatever the heartbeat says, so both must drop), one ``torchrun --max-restarts 10`` per replica group, our
  trainer ``benchmarks/peers_torchft_worker.py`` (Manager, ProcessGroupGloo,
  PGTransport healing, torchft's DDP, optimizer wrapper and DistributedSampler).
* ``cr``: Lightning DDP checkpoint-restart (``goodput.run_cr``, reused as it is: a
  ModelCheckpoint every ``--cr-every`` steps, a relaunch of all 4 ranks per death; its
  victim kills itself from a callback at the same steps, the one system not killed from
  outside).
* ``*-ff``: the fault-free run of each system, its loss reference.

Kills are real SIGKILLs sent by this driver, by pid, to the victim replica's training
process, when the system's own progress log (ReCoVer's step ledger, torchft's per-step log)
shows that the step before the kill step committed (torchft: logged by every group not
killed yet): the kill lands in the kill step. A torchft group restarted by torchrun that
forms a quorum of its own (a split brain) is reported; the largest quorum's steps count.

Printed per system: wall time (launch to the last process's exit, start-up included),
committed samples, effective throughput (committed samples of steps 1..N-1 / time from
step 0's commit to the last commit), pause per kill (the longest commit gap from the step
before the kill to two after it, minus the median fault-free step interval), time until
capacity is back (from the kill to the first commit with as many contributing replicas as
before it, after the drop; "never": not within the run), max |loss - own fault-free loss| per step, batch per step in
microbatches (min/mean), and samples lost or repeated, from the sample indices each
system consumed in its committed steps (ReCoVer: the ledger's committed microbatch ids
through the project's MicrobatchPlanner, the mapping its data loader uses; torchft: the
indices its trainer logged; only replicas that contributed to the step count): repeated
= applied more than once, lost = applied by the system's own fault-free run but never here.

Every launch (mpiexec, each torchrun, the lighthouse) runs in a ``proctree.ProcessTree``:
its whole tree is ended by pid before the next launch, also on timeouts and exceptions,
and any process that had to be ended is printed. Results go to
``benchmarks/results/peers.json``; the last line is the headline
``ReCoVer / torchft effective throughput: ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable
from benchmarks.proctree import ProcessTree, cmdline, become_subreaper, read_env

from lightning_recover.audit.ledger import microbatch_ids, resolve

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "bench_job.py"
WORKER = ROOT / "benchmarks" / "peers_torchft_worker.py"
RESULTS = ROOT / "benchmarks" / "results" / "peers.json"
REPLICAS = 4
#: bench_job.py's defaults (goodput.run_cr passes neither): every system uses the same.
SEED = 7
CORPUS_BYTES = 2_000_000
ALL_SYSTEMS = ("recover-ff", "recover", "recover-rejoin", "recover-rejoin-cold", "torchft-ff", "torchft", "torchft-low", "cr-ff", "cr")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="committed optimizer steps of every system")
    p.add_argument("--kills", default="10:1,25:3",
                   help="SIGKILLs as STEP:REPLICA,... (the replica's process dies in that step)")
    p.add_argument("--size", default="tiny", help="examples/model.py SIZES entry")
    p.add_argument("--mbs", type=int, default=4, help="microbatch size (sequences)")
    p.add_argument("--grad-accum", type=int, default=2, help="G: microbatches per replica per step (B = 4 x G)")
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), choices=ALL_SYSTEMS)
    p.add_argument("--torchft-heartbeat-ms", type=int, default=1000,
                   help="torchft-low: the lighthouse's --heartbeat_timeout_ms (torchft's default is 5000)")
    p.add_argument("--torchft-low-pg-timeout", type=float, default=1.0,
                   help="torchft-low: ProcessGroupGloo timeout, s (5 s otherwise): a survivor whose all-reduce waits "
                        "on the dead group is held this long whatever the heartbeat says")
    p.add_argument("--standbys", type=int, default=2,
                   help="recover-rejoin: recover.rejoin.standbys, warm standbys kept ahead of the kills (0 = cold spawns)")
    p.add_argument("--data-plane", default="mpi", choices=["mpi", "gloo"],
                   help="recover*: recover.data_plane, what carries the cross-replica gradient buckets")
    p.add_argument("--cr-every", type=int, default=10, help="cr: checkpoint every N steps")
    p.add_argument("--timeout", type=float, default=900, help="hard limit per system run, seconds")
    p.add_argument("--quiet-wait", type=float, default=5.0,
                   help="before each run wait up to this many seconds for other work on the machine to stop")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: 30 steps, kills 8:1,16:3, no cr; torchft only if it is installed")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.kills = 30, "8:1,16:3"
        args.systems = [s for s in args.systems if not s.startswith("cr")]
        if shutil.which("torchft_lighthouse") is None:
            args.systems = [s for s in args.systems if not s.startswith("torchft")]
    args.kill_plan = parse_kills(args.kills, args.steps)
    if any(s.startswith("torchft") for s in args.systems) and shutil.which("torchft_lighthouse") is None:
        p.error("torchft is not installed (no torchft_lighthouse on PATH): pip install -e '.[peers]' with your torch "
                "already installed, or leave the torchft systems out with --systems")
    return args


def parse_kills(spec: str, steps: int) -> list[tuple[int, int]]:
    """``"10:1,25:3"`` -> [(10, 1), (25, 3)]: (step, replica), checked against the run."""
    out: list[tuple[int, int]] = []
    for part in filter(None, (s.strip() for s in spec.split(","))):
        try:
            step, replica = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"--kills entry {part!r} is not STEP:REPLICA (e.g. 10:1)") from None
        if not 0 < step < steps:
            raise SystemExit(f"--kills step {step} must lie in 1..{steps - 1} (--steps {steps})")
        if not 0 <= replica < REPLICAS:
            raise SystemExit(f"--kills replica {replica} must be in 0..{REPLICAS - 1}")
        out.append((step, replica))
    if len({r for _, r in out}) != len(out) or len(out) >= REPLICAS:
        raise SystemExit(f"--kills {spec!r}: kill distinct replicas, and leave at least one of {REPLICAS}")
    return sorted(out)


# ------------------------------------------------------------------------------- records
@dataclass
class Step:
    """One committed step as the system itself logged it."""

    t: float  # wall time of the commit
    loss: float  # mean microbatch loss of the step
    batch: int  # microbatches applied
    contributors: int  # replicas whose microbatches were applied
    indices: list[int]  # sample indices applied


@dataclass
class Run:
    name: str
    ok: bool = False
    wall_s: float = 0.0
    steps: dict[int, Step] = field(default_factory=dict)
    kills: list[dict] = field(default_factory=list)  # {"step", "replica", "t", "pid"}
    notes: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    split_brain_steps: int = 0
    foreign_cores: float | None = None  # other work on the machine during the run (cores)
    #: Per kill, (commit gap around it, kill -> capacity back), for a system whose step numbers
    #: repeat after a restart (checkpoint-restart): the step-number rule of metrics() does not apply.
    kill_gaps: list[tuple[float, float]] | None = None
    log_tail: str = ""


class JsonlTail:
    """Reads the complete lines appended to a JSON-lines file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line torn by a SIGKILL
        return out


class Killer:
    """SIGKILLs each planned victim once the system's progress shows the step before its kill step."""

    def __init__(self, plan: list[tuple[int, int]], victim_pid: Callable[[int], int | None]) -> None:
        self.pending = list(plan)
        self.victim_pid = victim_pid
        self.fired: list[dict] = []

    def check(self, committed_step: int) -> None:
        while self.pending and committed_step >= self.pending[0][0] - 1:
            step, replica = self.pending[0]
            pid = self.victim_pid(replica)
            if pid is None:
                return  # not found yet (a restarting torchft group): try again at the next poll
            self.pending.pop(0)
            t = time.time()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.fired.append({"step": step, "replica": replica, "t": t, "pid": pid, "seen_step": committed_step})
            print(f"    SIGKILL replica {replica} (pid {pid}) at step {step}", flush=True)


def job_env() -> dict[str, str]:
    from lightning_recover.cli.mpiexec import launch_env

    env = launch_env()
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
                "PYTHONWARNINGS": "ignore"})
    return env


def planner_indices(args: argparse.Namespace) -> Callable[[int], list[int]]:
    """microbatch id -> sample indices, exactly as ReCoVer's data loader maps them (bench_job.py's data)."""
    from examples.model import SIZES, ByteDataset, read_corpus

    from lightning_recover.workload.planner import MicrobatchPlanner

    n = len(ByteDataset(read_corpus(max_bytes=CORPUS_BYTES), SIZES[args.size]["block_size"]))
    planner = MicrobatchPlanner(n, REPLICAS * args.grad_accum, args.mbs, shards=1, seed=SEED)
    return lambda gid: list(planner.sample_indices(gid, 0))


# ------------------------------------------------------------------------------- ReCoVer
def run_recover(args: argparse.Namespace, name: str, outdir: Path, *, rejoin: bool, kills: list[tuple[int, int]],
                indices: Callable[[int], list[int]], standbys: int = 0) -> Run:
    outdir.mkdir(parents=True, exist_ok=True)
    job = [sys.executable, str(JOB), "--system", "recover", "--shards", "1", "--grad-accum", str(args.grad_accum),
           "--mbs", str(args.mbs), "--steps", str(args.steps), "--size", args.size, "--out", str(outdir),
           "--data-plane", args.data_plane]
    if rejoin:
        job += ["--rejoin", "--rejoin-standbys", str(standbys)]
    cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(REPLICAS), "--", *job]
    run = Run(name)
    ledger = JsonlTail(outdir / "ledger.jsonl")
    lines: list[dict] = []
    t0 = time.time()
    with open(outdir / "job.log", "wb") as log, ProcessTree(cmd, name, env=job_env(), cwd=ROOT, stdout=log,
                                                            stderr=subprocess.STDOUT) as tree:

        def victim(replica: int) -> int | None:
            # The replica's original rank (shards = 1: rank = replica): the earliest-started
            # process of the tree running bench_job.py with that MPI rank (a re-join replacement
            # starts later).
            found = []
            for pid, start in tree.seen.items():
                env = read_env(pid)
                if env.get("OMPI_COMM_WORLD_RANK") == str(replica) and _cmdline_has(pid, str(JOB)):
                    found.append((start, pid))
            return min(found)[1] if found else None

        killer = Killer(kills, victim)
        last_scan = 0.0
        while True:
            now = time.time()
            if now - last_scan > 0.5:  # the /proc scan costs CPU the job needs: twice a second
                rc = tree.poll()
                last_scan = now
            else:
                rc = tree.proc.poll()
            new = ledger.read()
            lines += new
            if lines:
                killer.check(max(d["step"] for d in lines))
            if rc is not None:
                break
            if now - t0 > args.timeout:
                run.notes.append(f"timed out after {args.timeout:.0f} s")
                break
            time.sleep(0.02)
        run.leftovers = tree.end()
        run.wall_s = time.time() - t0
    lines += ledger.read()
    run.kills = killer.fired
    clock = _read_json(outdir / "clock.json")
    by_step = {d["step"]: d for d in resolve(lines)}  # every step's replicas and roles, from compact lines too
    if clock and by_step:
        # Commit times: rank 0's StepClock (bench_job.py), anchored at its fit start.
        ends = [clock["wall_fit_start"] + clock["first_step_s"]]
        for dt in clock["intervals_s"]:
            ends.append(ends[-1] + dt)
        for i, s in enumerate(sorted(by_step)):
            d = by_step[s]
            ids = microbatch_ids(d)
            roles = d.get("roles") or {}
            contributing = [r for r in d["replicas"] if "spare" not in str(roles.get(str(r), roles.get(r, "")))]
            run.steps[s] = Step(t=ends[i] if i < len(ends) else float("nan"), loss=d["loss"], batch=d["committed"],
                                contributors=len(contributing), indices=[x for g in ids for x in indices(g)])
    run.ok = tree.proc.returncode == 0 and len(run.steps) == args.steps and not killer.pending
    if killer.pending:
        run.notes.append(f"kills not fired: {killer.pending}")
    if not run.ok:
        run.log_tail = (outdir / "job.log").read_text(errors="replace")[-3000:]
    return run


def _cmdline_has(pid: int, needle: str) -> bool:
    return needle in cmdline(pid)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------- torchft
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchft(args: argparse.Namespace, name: str, outdir: Path, *, heartbeat_ms: int, pg_timeout: float,
                kills: list[tuple[int, int]]) -> Run:
    outdir.mkdir(parents=True, exist_ok=True)
    run = Run(name)
    port = _free_port()
    env = job_env()
    env.update({"NUM_REPLICA_GROUPS": str(REPLICAS), "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"})
    trees: list[ProcessTree] = []
    logs = []
    t0 = time.time()
    try:
        lh_log = open(outdir / "lighthouse.log", "wb")
        logs.append(lh_log)
        trees.append(ProcessTree(
            ["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
             "--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"[::]:{port}"],
            f"{name} lighthouse", env=env, cwd=ROOT, stdout=lh_log, stderr=subprocess.STDOUT))
        for g in range(REPLICAS):
            log = open(outdir / f"group{g}.log", "wb")
            logs.append(log)
            genv = {**env, "REPLICA_GROUP_ID": str(g)}
            trees.append(ProcessTree(
                ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "10",
                 str(WORKER), "--steps", str(args.steps), "--grad-accum", str(args.grad_accum), "--mbs", str(args.mbs),
                 "--size", args.size, "--seed", str(SEED), "--corpus-bytes", str(CORPUS_BYTES),
                 "--pg-timeout", str(pg_timeout), "--out", str(outdir)],
                f"{name} group {g}", env=genv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        groups = trees[1:]
        tails = [JsonlTail(outdir / f"progress.{g}.jsonl") for g in range(REPLICAS)]
        lines: list[dict] = []

        def victim(replica: int) -> int | None:
            try:
                pid = int((outdir / f"pid.{replica}").read_text())
            except (OSError, ValueError):
                return None
            return pid if _cmdline_has(pid, str(WORKER)) else None

        killer = Killer(kills, victim)
        finished_at: float | None = None
        last_scan = 0.0
        while True:
            now = time.time()
            scan = now - last_scan > 0.5
            if scan:
                last_scan = now
            rcs = [t.poll() if scan else t.proc.poll() for t in groups]
            for tail in tails:
                lines += tail.read()
            # Progress = the step every group never killed has logged as committed: the victim has
            # logged step k-1 before it dies in step k, and a restarted group training alone in a
            # quorum of its own (split brain) never paces the kills.
            killed = {k["replica"] for k in killer.fired}
            done: dict[int, int] = {}
            for d in lines:
                if d["committed"] and d["replica"] not in killed:
                    done[d["replica"]] = max(done.get(d["replica"], -1), d["step"])
            if len(done) == REPLICAS - len(killed):
                killer.check(min(done.values()))
            if all(rc is not None for rc in rcs):
                break
            if done and max(done.values()) >= args.steps - 1 and finished_at is None:
                finished_at = now
            # A group restarted near the end can form a quorum of its own and train alone (a
            # split brain seen here once): once the run is complete, stragglers get 30 s.
            if finished_at is not None and now - finished_at > 30:
                run.notes.append(f"groups {[g for g, rc in enumerate(rcs) if rc is None]} still running 30 s after the "
                                 "last step committed; ended")
                break
            if now - t0 > args.timeout:
                run.notes.append(f"timed out after {args.timeout:.0f} s")
                break
            time.sleep(0.02)
        rcs = [t.proc.poll() for t in groups]
    finally:
        for t in reversed(trees):  # the groups first, then the lighthouse they talk to
            run.leftovers += t.end()
        for f in logs:
            f.close()
    run.wall_s = time.time() - t0
    for tail in tails:
        lines += tail.read()
    run.kills = killer.fired
    by_step: dict[int, list[dict]] = {}
    for d in lines:
        if d["committed"]:
            by_step.setdefault(d["step"], []).append(d)
    killed = {k["replica"] for k in killer.fired}
    split: list[int] = []  # steps committed by two quorums at once (a split brain)
    split_groups: set[int] = set()
    for s, ds in sorted(by_step.items()):
        # One quorum's lines of a step share its lighthouse quorum id (healing groups included:
        # not counted in participants, not participating). Lines of another id come from a
        # second quorum training its own copy: the step is the largest quorum's (on a tie, the
        # one holding a group never killed), and the split is reported.
        quorums: dict[object, list[dict]] = {}
        for d in ds:
            quorums.setdefault(d.get("quorum_id", d["participants"]), []).append(d)
        main_id = max(quorums, key=lambda q: (len(quorums[q]), any(d["replica"] not in killed for d in quorums[q])))
        main = quorums[main_id]
        part = [d for d in main if d["participating"]]
        if len(quorums) > 1:
            split.append(s)
            split_groups.update(d["replica"] for q, ds_q in quorums.items() if q != main_id for d in ds_q)
        if not part:
            continue
        run.steps[s] = Step(t=max(d["t"] for d in main), loss=statistics.fmean(d["loss"] for d in part),
                            batch=len(part) * args.grad_accum, contributors=len(part),
                            indices=[i for d in part for i in d["indices"]])
    run.split_brain_steps = len(split)
    if split:
        run.notes.append(f"SPLIT BRAIN: {len(split)} step number(s) (first {split[0]}) were also committed by a second "
                         f"quorum (groups {sorted(split_groups)}, training their own copy); the largest quorum's steps are kept")
    run.notes.append(f"{sum(1 for d in lines if not d['committed'])} step attempt(s) discarded (should_commit false)")
    run.ok = all(rc == 0 for rc in rcs) and len(run.steps) >= args.steps and not killer.pending
    if killer.pending:
        run.notes.append(f"kills not fired: {killer.pending}")
    if not run.ok:
        run.log_tail = "\n".join((outdir / f"group{g}.log").read_text(errors="replace")[-1500:] for g in range(REPLICAS))
    return run


# ------------------------------------------------------------------------------- checkpoint-restart
def run_checkpoint_restart(args: argparse.Namespace, name: str, outdir: Path, kills: list[tuple[int, int]],
                           indices: Callable[[int], list[int]]) -> Run:
    """goodput.run_cr as it is (its victim SIGKILLs itself from a callback), read into a Run."""
    from benchmarks import goodput

    ns = argparse.Namespace(grad_accum=args.grad_accum, mbs=args.mbs, steps=args.steps, size=args.size,
                            quiet_wait=0.0, timeout=args.timeout)
    rec = goodput.run_cr(ns, outdir, args.cr_every, [{"step": s, "rank": r} for s, r in kills])
    run = Run(name, ok=rec["ok"], wall_s=rec["wall_s"], notes=[f"{rec['launches']} launch(es), "
                                                                 f"{rec['recomputed_steps']} step(s) computed again"])
    run.leftovers = [x for a in rec["attempts"] for x in a.get("leftovers", [])]
    run.kills = [{"step": k["step"], "replica": k["rank"], "t": k["t"]} for k in rec["kills_fired"]]
    last: dict[int, dict] = {}
    events = goodput.read_jsonl(outdir / "loss.jsonl")
    for d in events:
        last[d["step"]] = d  # a step computed again after a restart: the value that stayed
    run.kill_gaps = []
    for k in run.kills:
        # Restart gap: the last step logged before the kill to the first one logged after it
        # (the relaunch's first step, which redoes steps since the checkpoint).
        before = [d["t"] for d in events if d["t"] <= k["t"]]
        after = [d["t"] for d in events if d["t"] > k["t"]]
        if before and after:
            run.kill_gaps.append((after[0] - before[-1], after[0] - k["t"]))
    B = REPLICAS * args.grad_accum
    for s, d in sorted(last.items()):
        run.steps[s] = Step(t=d["t"], loss=d["loss"], batch=B, contributors=REPLICAS,
                            indices=[i for g in range(s * B, s * B + B) for i in indices(g)])
    if not run.ok:
        run.log_tail = rec.get("log_tail", "")
    return run


# ------------------------------------------------------------------------------- metrics
def metrics(run: Run, ref: Run | None, mbs: int) -> dict:
    """The printed figures of one run (pure: tests call it)."""
    steps = sorted(run.steps)
    out: dict = {"name": run.name, "ok": run.ok, "wall_s": run.wall_s, "steps": len(steps),
                 "split_brain_steps": run.split_brain_steps, "foreign_cores": run.foreign_cores}
    if not steps:
        return out
    S = run.steps
    out["committed_samples"] = sum(S[s].batch for s in steps) * mbs
    span = S[steps[-1]].t - S[steps[0]].t
    out["train_s"] = span
    out["throughput"] = sum(S[s].batch for s in steps[1:]) * mbs / span if span > 0 else 0.0
    batches = [S[s].batch for s in steps]
    out["batch_min"], out["batch_mean"] = min(batches), statistics.fmean(batches)
    ts = [S[s].t for s in steps]
    ref_steps = sorted(ref.steps) if ref else []
    ref_iv = [ref.steps[b].t - ref.steps[a].t for a, b in zip(ref_steps, ref_steps[1:])] if ref else []
    step_s = statistics.median(ref_iv) if ref_iv else statistics.median(b - a for a, b in zip(ts, ts[1:]))
    out["median_step_s"] = step_s
    pauses, back = [], []
    for i, k in enumerate(run.kills):
        if run.kill_gaps is not None:
            gap, cap = run.kill_gaps[i]
            pauses.append(gap - step_s)
            back.append(cap)
            continue
        # The kill lands in step k (fired once step k-1 was logged everywhere; a torchft group
        # running a step ahead of the others takes it in step k+1): the pause is the longest
        # commit gap from step k-1 to k+2 beyond a normal step. Capacity: "need" is the most
        # contributing replicas of the few steps before (a victim that died before logging
        # step k-1 still counts); it is back at the first commit with that many again after
        # the first one with fewer (0 if it never dropped; None if it never came back).
        k0 = k["step"]
        window = [s for s in range(k0 - 1, k0 + 3) if s in S]
        gaps = [S[b].t - S[a].t for a, b in zip(window, window[1:]) if b == a + 1]
        pauses.append(max(gaps) - step_s if gaps else None)
        need = max((S[s].contributors for s in range(k0 - 3, k0) if s in S), default=0)
        dip = next((s for s in steps if k0 <= s <= k0 + 5 and S[s].contributors < need), None)
        if dip is None:
            back.append(0.0)
            continue
        again = next((s for s in steps if s > dip and S[s].contributors >= need), None)
        back.append(max(0.0, S[again].t - k["t"]) if again is not None else None)
    out["pause_s"], out["capacity_back_s"] = pauses, back
    if ref and ref.steps:
        common = [s for s in steps if s in ref.steps]
        d = [abs(S[s].loss - ref.steps[s].loss) for s in common]
        out["max_dloss"] = max(d) if d else None
        out["final_dloss"] = d[-1] if d else None
        applied = [i for s in steps for i in S[s].indices]
        out["samples_repeated"] = len(applied) - len(set(applied))
        ref_set = {i for s in ref_steps if s <= steps[-1] for i in ref.steps[s].indices}
        out["samples_lost"] = len(ref_set - set(applied))
    return out


def fmt_list(xs: list, spec: str = ".2f", none: str = "never") -> str:
    return "/".join(none if x is None else format(x, spec) for x in xs) or "-"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.common import children_cpu, proc_stat, wait_quiet

    work = Path(tempfile.mkdtemp(prefix="lr-peers-"))
    B = REPLICAS * args.grad_accum
    print(f"peers: {REPLICAS} replicas x 1 rank, model {args.size}, {args.steps} steps of B = {B} microbatches x {args.mbs} "
          f"samples, SIGKILL {', '.join(f'replica {r} at step {s}' for s, r in args.kill_plan)}; systems {args.systems} "
          f"(work dir {work})", flush=True)
    indices = planner_indices(args)
    runs: dict[str, Run] = {}
    t_all = time.time()
    for name in args.systems:
        kills = [] if name.endswith("-ff") else args.kill_plan
        waited, _ = wait_quiet(args.quiet_wait)
        print(f"  {name} ...", flush=True)
        outdir = work / name
        stat0, cpu0, t0 = proc_stat(), children_cpu(), time.time()
        if name.startswith("recover"):
            run = run_recover(args, name, outdir, rejoin=name.startswith("recover-rejoin"), kills=kills, indices=indices,
                              standbys=0 if name == "recover-rejoin-cold" else args.standbys)
        elif name.startswith("torchft"):
            low = name == "torchft-low"
            hb = args.torchft_heartbeat_ms if low else 5000
            pgt = args.torchft_low_pg_timeout if low else 5.0
            run = run_torchft(args, name, outdir, heartbeat_ms=hb, pg_timeout=pgt, kills=kills)
            run.notes.append(f"lighthouse heartbeat timeout {hb} ms, ProcessGroupGloo timeout {pgt:g} s")
        else:
            run = run_checkpoint_restart(args, name, outdir, kills, indices)
        stat1, cpu1 = proc_stat(), children_cpu()
        if stat0 is not None and stat1 is not None:
            # Cores other work used meanwhile: all busy CPU time minus this run's own, over its wall time.
            run.foreign_cores = max(0.0, ((stat1[1] - stat0[1]) / os.sysconf("SC_CLK_TCK") - (cpu1 - cpu0))
                                    / max(time.time() - t0, 1e-9))
        runs[name] = run
        print(f"  {name}: {'ok' if run.ok else 'FAILED'}, {run.wall_s:.1f} s wall, {len(run.steps)} steps; "
              f"{'; '.join(run.notes)}", flush=True)
        if not run.ok:
            print(run.log_tail[-2500:], file=sys.stderr)
    total = time.time() - t_all

    def ref_of(name: str) -> Run | None:
        base = "recover" if name.startswith("recover") else name.split("-")[0]
        return runs.get(f"{base}-ff")

    table = {n: metrics(r, ref_of(n), args.mbs) for n, r in runs.items()}
    print()
    print(f"{REPLICAS} replicas x 1 rank on {os.cpu_count()} cores, model {args.size}, {args.steps} steps, B = {B} x {args.mbs} "
          f"samples; benchmark took {total:.0f} s")
    hdr = (f"{'system':20s} {'wall s':>7s} {'committed':>9s} {'samples/s':>9s} {'pause/kill s':>13s} {'capacity back s':>16s} "
           f"{'max|dloss|':>10s} {'batch min/mean':>14s} {'lost':>5s} {'repeated':>8s} {'others':>6s}")
    print(hdr)
    print("-" * len(hdr))
    for n, m in table.items():
        if "committed_samples" not in m:
            print(f"{n:20s} FAILED (no committed steps)")
            continue
        md = m.get("max_dloss")
        print(f"{n:20s} {m['wall_s']:7.1f} {m['committed_samples']:9d} {m['throughput']:9.1f} "
              f"{fmt_list(m['pause_s']):>13s} {fmt_list(m['capacity_back_s'], '.1f'):>16s} "
              f"{('%.1e' % md) if md is not None else '-':>10s} {m['batch_min']:>5d}/{m['batch_mean']:<8.2f} "
              f"{m.get('samples_lost', '-')!s:>5s} {m.get('samples_repeated', '-')!s:>8s} "
              f"{m['foreign_cores'] if m['foreign_cores'] is not None else float('nan'):6.2f}")
    print("samples/s: committed samples of steps 1..N-1 / time from step 0's commit to the last; pause: commit gap around "
          "the kill minus the median fault-free step; capacity back: kill -> first commit with as many contributing "
          "replicas as before; lost/repeated: sample indices vs the system's own fault-free run; others: cores other "
          "work on the (shared) machine used during the run")
    for n, r in runs.items():
        if r.split_brain_steps:
            print(f"split brain: {n}: {r.split_brain_steps} step(s) also committed by a second quorum (not counted above)")
        if r.leftovers:
            print(f"cleanup: {n} left {len(r.leftovers)} process(es) that had to be ended: {', '.join(r.leftovers)}")

    import torch

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "peers", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                           "load_avg_1min_at_end": os.getloadavg()[0]},
               "total_s": total, "table": table,
               "runs": {n: {**{k: v for k, v in asdict(r).items() if k not in ("steps", "log_tail")},
                            "loss": {s: st.loss for s, st in r.steps.items()},
                            "batch": {s: st.batch for s, st in r.steps.items()},
                            "t": {s: st.t for s, st in r.steps.items()}} for n, r in runs.items()}}
    args.out.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {args.out}")
    ok = all(r.ok for r in runs.values())
    ours = table.get("recover-rejoin") if "recover-rejoin" in table else table.get("recover")
    peer = table.get("torchft")
    if ours and peer and ours.get("throughput") and peer.get("throughput"):
        extra = ""
        if "recover" in table and "recover-rejoin" in table and table["recover"].get("throughput"):
            extra = f" (without re-join {table['recover']['throughput'] / peer['throughput']:.2f}x)"
        low = table.get("torchft-low")
        if low and low.get("throughput"):
            extra += (f"; vs torchft at {args.torchft_heartbeat_ms} ms heartbeat, {args.torchft_low_pg_timeout:g} s gloo timeout "
                      f"{ours['throughput'] / low['throughput']:.2f}x")
        print(f"ReCoVer / torchft effective throughput: {ours['throughput'] / peer['throughput']:.2f}x{extra}; "
              f"max |dloss| vs own fault-free run: ReCoVer {ours.get('max_dloss', float('nan')):.1e}, "
              f"torchft {peer.get('max_dloss', float('nan')):.1e}")
    elif ours and ours.get("throughput"):
        print(f"ReCoVer effective throughput: {ours['throughput']:.1f} samples/s, max |dloss| vs own fault-free run "
              f"{ours.get('max_dloss') if ours.get('max_dloss') is not None else float('nan'):.1e} (torchft not run)")
    else:
        print("ReCoVer / torchft effective throughput: n/a (a run failed or was not selected)")
    return 0 if ok else 1


if __name__ == "__main__":
    become_subreaper()  # a launch's orphans re-parent to us, so its cleanup still finds them
    sys.exit(main())
