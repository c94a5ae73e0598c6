"""The GPU check: one command for the day a GPU is lent, at most 8 minutes on one GPU with 16 cores.

    python -m benchmarks.gpu_check                  # CUDA if present, else CPU
    python -m benchmarks.gpu_check --device cpu     # the same code on a tiny model (CI smoke test)

Role: nothing else in the project runs the strategy on CUDA. This script launches short jobs
of the example's LLaMA (``examples/llama.py``) with ``strategy="recover_hsdp"``, every rank on
the *same* device, and checks, in order:

1. **planes**: CUDA gradients through the MPI and the gloo data planes (fp32, plain SGD, so a
   wrong sum shows in the parameters at once): 2 replicas, one SIGKILLed in step 1; each run
   must end as one process accumulating the same microbatches on the same device.
2. **bf16**: the same with ``precision="bf16-true"`` over the MPI plane (16-bit gradients,
   summed in fp32), against a bf16 process (looser tolerance: bf16 rounding).
3. **llama**: a ~1B LLaMA (Llama-3.2-1B's shape, byte vocabulary; ``tiny`` on CPU) in
   ``bf16-mixed`` with AdamW, fault-free vs one replica SIGKILLed, 2 replicas: same losses and
   parameters (the survivor sums the same microbatches in another order).
4. **overhead**: step time and peak memory of one replica under ``recover_hsdp`` against stock
   Lightning ``ModelParallelStrategy`` on the same device and the same samples (which must
   give the same losses), side by side with their ratio.

One GPU cannot test the NCCL planes: NCCL refuses two ranks of one communicator on one device
("Duplicate GPU detected"), so the cross-replica ``data_plane=nccl`` and the replica-local
group of a replica with more than one rank need one GPU per rank; here every replica is one
rank (``shards=1``) and its replica-local group a one-rank NCCL group. The report says so.

Writes ``<out>/gpu_check.json`` (every number, every check) and prints one line per check;
exit status 0 when every check passed. ``job`` and ``stock`` are its internal sub-commands
(one rank of a launched job; the stock Lightning run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SEED = 5
#: Per-size settings: the sequence length, samples per microbatch, corpus bytes to read.
SHAPES = {"tiny": {"seq": 32, "mbs": 2, "corpus": 60_000}, "1B": {"seq": 1024, "mbs": 2, "corpus": 400_000}}
#: The planes and bf16 checks' model: small on either device (the planes are under test, not the model).
PLANE_SIZE = "tiny"
#: Values sampled per parameter for the comparisons (evenly spaced over the flattened tensor).
SAMPLES = 64
NCCL_NOTE = ("not testable on one GPU: NCCL refuses two ranks of one communicator on one device "
             "(\"Duplicate GPU detected\"); data_plane=nccl and replicas of more than one rank need a GPU per rank")


# ---------------------------------------------------------------------- shared by the ranks, the stock run and the reference

def build(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """The LLaMA and the byte dataset of ``cfg``, seeded identically in every process."""
    import lightning as L
    import torch
    from examples.llama import LLAMA_SIZES, Llama
    from examples.model import ByteDataset, read_corpus

    L.seed_everything(SEED, verbose=False)
    shape = SHAPES[cfg["size"]]
    sizes = dict(LLAMA_SIZES[cfg["size"]], max_seq_len=shape["seq"])
    cls = _sgd_llama() if cfg["optimizer"] == "sgd" else Llama
    # On CUDA the weights are initialised there (a 1B model's init on one CPU core takes a minute).
    with torch.device("cuda" if cfg["device"] == "cuda" else "cpu"):
        model = cls(**sizes, lr=cfg["lr"])
    return model, ByteDataset(read_corpus(max_bytes=shape["corpus"]), shape["seq"])


def _sgd_llama() -> type:
    from examples.llama import Llama

    class SGDLlama(Llama):
        """Plain SGD: the update is the gradient, so a wrongly summed gradient shows in the parameters."""

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            import torch

            return torch.optim.SGD(self.parameters(), lr=self.cfg.lr)

    return SGDLlama


def fingerprint(model: Any) -> dict[str, Any]:
    """Every parameter's full tensor sampled at ``SAMPLES`` fixed places, and a digest of all their bytes."""
    import torch

    digest = hashlib.sha256()
    samples: dict[str, list[float]] = {}
    for name, p in sorted(model.named_parameters()):
        t = p.detach()
        t = (t.full_tensor() if hasattr(t, "full_tensor") else t).float().reshape(-1)
        idx = torch.linspace(0, t.numel() - 1, min(SAMPLES, t.numel()), device=t.device).long()
        samples[name] = t[idx].double().cpu().tolist()
        digest.update(t.cpu().numpy().tobytes())
    return {"samples": samples, "sha256": digest.hexdigest()}


def sample_order(cfg: dict[str, Any], n: int, B: int) -> list[list[int]]:
    """The dataset indices of every microbatch of every step, in the strategy's order (its planner)."""
    from lightning_recover.workload.planner import MicrobatchPlanner

    planner = MicrobatchPlanner(n, B, SHAPES[cfg["size"]]["mbs"], shards=1, seed=SEED)
    return [planner.sample_indices(planner.global_id(step, offset), 0) for step in range(cfg["steps"]) for offset in range(B)]


class StepClock:
    """Wall time at the end of each optimizer step (device synchronised), as a Lightning callback."""

    def __new__(cls, cuda: bool) -> Any:
        import lightning as L
        import torch

        class _Clock(L.Callback):
            def __init__(self) -> None:
                self.ends: list[float] = []
                self.last = 0

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                if trainer.global_step != self.last:
                    if cuda:
                        torch.cuda.synchronize()
                    self.ends.append(time.perf_counter())
                    self.last = trainer.global_step

            def on_train_start(self, trainer: Any, *args: Any) -> None:
                if cuda:
                    torch.cuda.synchronize()
                self.ends = [time.perf_counter()]

        return _Clock()


def step_times(ends: list[float]) -> list[float]:
    """Seconds per optimizer step, without the first (warm-up: allocations, kernel selection)."""
    diffs = [b - a for a, b in zip(ends, ends[1:])]
    return diffs[1:] if len(diffs) > 1 else diffs


def peak_memory(cuda: bool) -> dict[str, float]:
    import torch

    if cuda:
        return {"peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30, "peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _prepare(cfg: dict[str, Any]) -> None:
    import torch

    if cfg["device"] == "cpu":
        torch.set_num_threads(1)
    else:
        # The same microbatch gives the same gradient wherever it is computed (a survivor replays the lost
        # replica's): deterministic kernels (CUBLAS_WORKSPACE_CONFIG is set by the launcher's environment).
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Attention through the math kernels: the flash and memory-efficient backwards accumulate with
        # atomics (not bitwise reproducible). Ours and stock alike, so the overhead ratio stays fair.
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


# ---------------------------------------------------------------------- the ranks, the stock run, the reference

def job(cfg_path: str) -> None:
    """One rank of a launched ``recover_hsdp`` run; every surviving rank writes ``rank{R}.json``."""
    cfg = json.loads(Path(cfg_path).read_text())
    _prepare(cfg)
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_recover.callbacks import FaultInjection
    from lightning_recover.strategies import ReCoVerHSDPStrategy

    out = Path(cfg["out"])
    cuda = cfg["device"] == "cuda"
    model, data = build(cfg)
    strategy = ReCoVerHSDPStrategy(
        shards=1, grad_accum=cfg["grad_accum"], seed=SEED, ledger_path=out / "ledger.jsonl", data_plane=cfg["plane"],
        bucket_mb=cfg["bucket_mb"], sdc_every_n_steps=0, stuck_timeout_s=300.0,
    )
    clock = StepClock(cuda)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, precision=cfg["precision"], max_steps=cfg["steps"],
        callbacks=[FaultInjection(cfg["faults"]), clock], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=SHAPES[cfg["size"]]["mbs"]))
    comm = strategy.comm
    assert comm is not None
    result = {"rank": comm.rank, "alive": list(comm.alive_replicas), "global_step": trainer.global_step,
              "step_s": step_times(clock.ends), "memory": peak_memory(cuda), "fingerprint": fingerprint(model),
              "data_plane": comm.data_plane.kind if comm.data_plane else None,
              "device": str(strategy.root_device)}
    (out / f"rank{comm.rank}.json").write_text(json.dumps(result))


def stock(cfg_path: str) -> None:
    """Stock Lightning ``ModelParallelStrategy`` (one process), the same model, samples and accumulation."""
    cfg = json.loads(Path(cfg_path).read_text())
    _prepare(cfg)
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, Subset

    out = Path(cfg["out"])
    cuda = cfg["device"] == "cuda"
    model, data = build(cfg)
    B = cfg["grad_accum"]
    losses: list[float] = []
    step = model.training_step

    def recorded(batch: Any, batch_idx: int) -> Any:
        loss = step(batch, batch_idx)
        losses.append(float(loss.detach()))
        return loss

    model.training_step = recorded  # type: ignore[method-assign]
    order = [i for mb in sample_order(cfg, len(data), B) for i in mb]
    clock = StepClock(cuda)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        precision=cfg["precision"], max_steps=cfg["steps"], accumulate_grad_batches=B, callbacks=[clock], logger=False,
        use_distributed_sampler=False,  # the sample order is the strategy planner's (a DistributedSampler would shuffle it)
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(Subset(data, order), batch_size=SHAPES[cfg["size"]]["mbs"], shuffle=False))
    step_losses = [statistics.fmean(losses[i * B:(i + 1) * B]) for i in range(len(losses) // B)]
    (out / "stock.json").write_text(json.dumps({"losses": step_losses, "step_s": step_times(clock.ends), "memory": peak_memory(cuda)}))


def reference(cfg: dict[str, Any], replicas: int) -> dict[str, Any]:
    """One process on the same device accumulating the same B microbatches per step (in this process)."""
    import torch

    _prepare(cfg)
    model, data = build(cfg)
    device = torch.device("cuda" if cfg["device"] == "cuda" else "cpu")
    if cfg["precision"] == "bf16-true":
        model = model.to(torch.bfloat16)
    B = replicas * cfg["grad_accum"]
    opt = model.configure_optimizers()
    model.log = lambda *a, **k: None
    order = sample_order(cfg, len(data), B)
    losses = []
    for step in range(cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in order[step * B:(step + 1) * B]:
            batch = (torch.stack([data[i][0] for i in mb]).to(device), torch.stack([data[i][1] for i in mb]).to(device))
            loss = model.training_step(batch, 0)
            (loss / B).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total / B)
    return {"losses": losses, "fingerprint": fingerprint(model)}


# ---------------------------------------------------------------------- the driver

def launch(name: str, cfg: dict[str, Any], nprocs: int, out: Path, timeout: float) -> dict[str, Any]:
    """``lightning-recover launch -n nprocs`` of :func:`job`; its whole process tree is ended before returning."""
    from benchmarks.proctree import ProcessTree

    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "out": str(run_dir)}
    (run_dir / "config.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(nprocs), "--",
           sys.executable, str(Path(__file__).resolve()), "job", str(run_dir / "config.json")]
    t0 = time.monotonic()
    with open(run_dir / "job.log", "w") as log, ProcessTree(cmd, name, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT) as tree:
        timed_out = tree.wait(timeout) is None
        tree.end()
        rc = tree.proc.returncode
    ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in sorted(run_dir.glob("rank*.json"))}
    from lightning_recover.audit.ledger import read_ledger

    ledger = read_ledger(run_dir / "ledger.jsonl") if (run_dir / "ledger.jsonl").exists() else []
    first = ranks[min(ranks)] if ranks else None
    return {"rc": rc, "timed_out": timed_out, "wall_s": time.monotonic() - t0, "survivors": sorted(ranks),
            "losses": [line["loss"] for line in ledger], "faults": [line["faults"] for line in ledger],
            "committed": [line["committed"] for line in ledger], "recovery_s": [line.get("recovery_s") for line in ledger],
            "first": first, "log": str(run_dir / "job.log")}


def run_stock(cfg: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    from benchmarks.proctree import ProcessTree

    run_dir = out / "stock"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "out": str(run_dir)}
    (run_dir / "config.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, str(Path(__file__).resolve()), "stock", str(run_dir / "config.json")]
    with open(run_dir / "stock.log", "w") as log, ProcessTree(cmd, "stock", cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT) as tree:
        timed_out = tree.wait(timeout) is None
        tree.end()
    result = json.loads((run_dir / "stock.json").read_text()) if (run_dir / "stock.json").exists() else None
    return {"timed_out": timed_out, "rc": tree.proc.returncode, "result": result, "log": str(run_dir / "stock.log")}


def _env() -> dict[str, str]:
    from lightning_recover.cli.mpiexec import launch_env

    env = launch_env()
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
                "PYTHONWARNINGS": "ignore", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    return env


def compare(run: dict[str, Any] | None, ref: dict[str, Any], rtol: float, atol: float) -> dict[str, Any]:
    """How far a run's losses and sampled parameters are from ``ref``'s, and whether within tolerance."""
    if run is None or not run.get("fingerprint") and not run.get("first"):
        return {"ok": False, "why": "the run left no result"}
    fp = run["fingerprint"] if "fingerprint" in run else run["first"]["fingerprint"]
    losses = run["losses"]
    loss_diff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref["losses"])), default=float("inf"))
    worst = 0.0
    for name, values in ref["fingerprint"]["samples"].items():
        for a, b in zip(fp["samples"].get(name, []), values):
            worst = max(worst, abs(a - b) / (atol + rtol * abs(b)))
    ok = len(losses) == len(ref["losses"]) and loss_diff <= rtol and worst <= 1.0 and fp["samples"].keys() == ref["fingerprint"]["samples"].keys()
    return {"ok": ok, "loss_max_rel_diff": loss_diff, "param_worst_over_tolerance": worst, "rtol": rtol, "atol": atol,
            "bitwise_equal": fp["sha256"] == ref["fingerprint"]["sha256"]}


def kill(rank: int, step: int = 1) -> list[dict[str, Any]]:
    return [{"step": step, "rank": rank, "phase": "backward", "kind": "kill"}]


def recovered(run: dict[str, Any], steps: int) -> bool:
    """The run finished every step on one survivor rank, after exactly one fault, with B constant."""
    return (run["rc"] == 0 and not run["timed_out"] and len(run["losses"]) == steps and sum(map(len, run["faults"])) == 1
            and len(set(run["committed"])) == 1 and run["survivors"] == [0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    ap.add_argument("--size", default=None, help="the llama/overhead model: 1B on CUDA (default), tiny on CPU")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per launched run at most")
    ap.add_argument("--budget", type=float, default=480.0,
                    help="seconds for the whole check (a lent GPU's time is counted): a run is cut at what is left of it")
    args = ap.parse_args(argv)
    # Before CUDA starts in this process (the one-process references run here): deterministic cuBLAS.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but this torch sees no CUDA device (torch.cuda.is_available() is False); use --device cpu",
              file=sys.stderr)
        return 2
    size = args.size or ("1B" if device == "cuda" else "tiny")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    report: dict[str, Any] = {"device": device, "gpu": gpu, "torch": torch.__version__, "host": platform.node(),
                              "cores": os.cpu_count(), "size": size, "checks": {}}
    checks = report["checks"]

    def limit() -> float:
        """A launched run's time limit: --timeout, or what is left of --budget (at least 20 s: a cut run fails its check)."""
        return max(20.0, min(args.timeout, args.budget - (time.monotonic() - t_start)))

    def record(name: str, ok: bool, line: str, **details: Any) -> None:
        checks[name] = {"ok": ok, **details}
        print(f"gpu_check: {name:<10} {'ok  ' if ok else 'FAIL'} {line}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))

    base = {"device": device, "size": PLANE_SIZE, "optimizer": "sgd", "lr": 0.5, "grad_accum": 2, "steps": 3, "bucket_mb": 4.0}
    # 1. CUDA gradients through the MPI and gloo data planes (fp32, SGD), a replica SIGKILLed.
    planes: dict[str, Any] = {"nccl": NCCL_NOTE}
    ref32 = reference({**base, "precision": "32-true"}, replicas=2)
    all_ok = True
    for plane in ("mpi", "gloo"):
        run = launch(f"plane_{plane}", {**base, "precision": "32-true", "plane": plane, "faults": kill(1)}, 2, out, limit())
        cmp = compare(run, ref32, rtol=1e-4, atol=1e-6)
        # Every rank on the device under test (cuda:0 for all of them on one GPU), over the plane asked for.
        ok = (recovered(run, base["steps"]) and cmp["ok"] and run["first"]["data_plane"] == plane
              and run["first"]["device"].startswith(device))
        all_ok &= ok
        planes[plane] = {"ok": ok, "vs_one_process": cmp, "run": {k: run[k] for k in ("rc", "wall_s", "losses", "faults", "recovery_s", "log")},
                         "rank_device": run["first"]["device"] if run["first"] else None}
    record("planes", all_ok, f"mpi {planes['mpi']['ok']}, gloo {planes['gloo']['ok']} (one kill each, vs one process); nccl: not on one GPU",
           **planes)

    # 2. bf16 gradients (bf16-true) over the MPI plane.
    cfg16 = {**base, "precision": "bf16-true", "plane": "mpi", "lr": 0.1}
    run = launch("bf16", {**cfg16, "faults": kill(1)}, 2, out, limit())
    cmp = compare(run, reference(cfg16, replicas=2), rtol=3e-2, atol=3e-2)
    record("bf16", recovered(run, base["steps"]) and cmp["ok"],
           f"bf16-true over MPI, one kill: loss max rel diff {cmp.get('loss_max_rel_diff', float('nan')):.2e} vs a bf16 process",
           vs_one_process=cmp, losses=run["losses"], log=run["log"])

    # 3. The LLaMA (1B on CUDA), bf16-mixed, AdamW: fault-free vs one kill, 2 replicas.
    steps = 4 if device == "cuda" else 3
    big = {"device": device, "size": size, "optimizer": "adamw", "lr": 3e-4, "grad_accum": 2, "steps": steps, "precision": "bf16-mixed",
           "plane": "mpi", "bucket_mb": 64.0 if device == "cuda" else 4.0}
    from examples.llama import LLAMA_SIZES, LlamaConfig, parameter_count

    n_params = parameter_count(LlamaConfig(**LLAMA_SIZES[size]))
    free = launch("llama_fault_free", {**big, "faults": []}, 2, out, limit())
    killed = launch("llama_kill", {**big, "faults": kill(1)}, 2, out, limit())
    ok_free = free["rc"] == 0 and len(free["losses"]) == steps and free["first"] is not None
    cmp = compare(killed, {"losses": free["losses"], "fingerprint": free["first"]["fingerprint"]}, rtol=1e-3, atol=1e-5) if ok_free else {"ok": False}
    record("llama", ok_free and recovered(killed, steps) and cmp["ok"],
           f"{n_params / 1e9:.2f}B params, bf16-mixed: one kill vs fault-free, loss max rel diff {cmp.get('loss_max_rel_diff', float('nan')):.2e}, "
           f"bitwise {cmp.get('bitwise_equal')}", params=n_params, vs_fault_free=cmp, fault_free_losses=free["losses"],
           kill_losses=killed["losses"], recovery_s=killed["recovery_s"], fault_free_step_s=free["first"]["step_s"] if free["first"] else None)

    # 4. One replica under recover_hsdp vs stock ModelParallelStrategy: same samples, step time, peak memory.
    solo = {**big, "steps": 6 if device == "cuda" else 3, "grad_accum": 4, "faults": []}
    ours = launch("overhead_recover", solo, 1, out, limit())
    theirs = run_stock(solo, out, limit())
    stock_res = theirs["result"]
    ok = ours["rc"] == 0 and ours["first"] is not None and stock_res is not None
    line = "a run failed"
    details: dict[str, Any] = {"recover": ours["first"] and {"step_s": ours["first"]["step_s"], "memory": ours["first"]["memory"]},
                               "stock": stock_res, "stock_log": theirs["log"]}
    if ok:
        mine, base_t = statistics.median(ours["first"]["step_s"]), statistics.median(stock_res["step_s"])
        key = "peak_allocated_gb" if device == "cuda" else "peak_rss_gb"
        mem_a, mem_b = ours["first"]["memory"][key], stock_res["memory"][key]
        loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["losses"], stock_res["losses"]))
        ok = loss_diff <= 1e-3 and len(ours["losses"]) == len(stock_res["losses"])
        details.update(step_s_recover=mine, step_s_stock=base_t, step_time_ratio=mine / base_t, memory_key=key, memory_recover_gb=mem_a,
                       memory_stock_gb=mem_b, memory_ratio=mem_a / mem_b, loss_max_rel_diff_vs_stock=loss_diff)
        line = (f"step {mine:.3f}s vs stock {base_t:.3f}s (x{mine / base_t:.2f}), {key} {mem_a:.2f} vs {mem_b:.2f} GB "
                f"(x{mem_a / mem_b:.2f}), losses vs stock max rel diff {loss_diff:.1e}")
    record("overhead", ok, line, **details)

    report["elapsed_s"] = time.monotonic() - t_start
    report["passed"] = all(c["ok"] for c in checks.values())
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"gpu_check: {'passed' if report['passed'] else 'FAILED'} in {report['elapsed_s']:.0f}s; report {out / 'gpu_check.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "job":
        job(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "stock":
        stock(sys.argv[2])
    else:
        sys.exit(main())
