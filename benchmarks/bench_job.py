"""The launched training job behind ``benchmarks/overhead.py`` and ``benchmarks/goodput.py``.

One script, four systems, the same model, data and step clock:

* ``recover`` / ``adaptive``: :class:`ReCoVerHSDPStrategy` (policy static / adaptive),
  launched with ``lightning-recover launch`` (``mpiexec --with-ft ulfm``), optionally
  with a :class:`FaultInjection` schedule (``--faults``).
* ``stock``: Lightning's ``ModelParallelStrategy(data_parallel_size=W,
  tensor_parallel_size=S)`` with FSDP2 ``fully_shard`` applied in ``configure_model`` on
  its 2-D device mesh (HSDP: replicate over ``data_parallel``, shard over
  ``tensor_parallel``; S = 1 is plain replication) and Lightning's
  ``accumulate_grad_batches=G``. Gradient sync is switched off on the accumulating
  microbatches (``set_requires_gradient_sync``) so that a step does one reduce-scatter
  and one all-reduce, as DDP's ``no_sync`` gives DDP users automatically.
  ``stock-naive`` leaves it on (what Lightning + FSDP2 does out of the box: a full HSDP
  gradient reduction after every microbatch).
* ``ddp``: Lightning ``DDPStrategy`` on gloo (S must be 1), whose ``no_sync`` skips the
  all-reduce on accumulating microbatches: the other stock way to replicate.
* ``cr``: checkpoint-restart baseline: Lightning ``DDPStrategy`` on gloo (S must be 1),
  ``ModelCheckpoint(every_n_train_steps=N, save_last=True)``, resumed with
  ``ckpt_path="last"`` when a checkpoint exists. ``--kills`` SIGKILLs a victim rank at
  a given step (backward of the step's first microbatch), once per kill: a marker file
  in ``--out`` records that it fired, so the relaunched job does not fire it again.

Every system trains on exactly the same samples: the stock/cr module fetches each
microbatch itself through the project's :class:`MicrobatchPlanner` (step t, microbatch
k of replica r has global id ``t*B + r*G + k``, B = W*G), the samples ReCoVer's static
plan assigns to step t. The step's gradient is the mean over the same B microbatches in
both, so the fault-free loss trajectories agree to float rounding (dropout off).

The step clock (:class:`StepClock`) is the same callback in every system: rank 0
records ``time.perf_counter()`` at the ``on_train_batch_end`` where
``trainer.global_step`` has advanced, i.e. once per optimizer step, end to end. With
``--record-loss`` the stock/cr job all-reduces the step's mean microbatch loss over the
world (the ledger's ``loss`` for ReCoVer) and rank 0 appends it to ``loss.jsonl``.

Outputs in ``--out``: ``clock.json`` (rank 0; per-step end times), ``ledger.jsonl``
(ReCoVer), ``params.pt`` (ReCoVer with ``--save-params``: rank 0's final parameters), ``loss.jsonl`` (cr), ``kill{i}.marker`` (cr), ``ckpt/`` (cr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

T_START = time.time()

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_recover.workload.planner import MicrobatchPlanner  # noqa: E402
from examples.model import GPT, SIZES, ByteDataset, read_corpus  # noqa: E402

SYSTEMS = ("recover", "adaptive", "stock", "stock-naive", "ddp", "cr")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=SYSTEMS, required=True)
    ap.add_argument("--shards", type=int, default=1, help="S: ranks per replica")
    ap.add_argument("--grad-accum", type=int, default=2, help="G: microbatches per replica per step")
    ap.add_argument("--mbs", type=int, default=8, help="per-rank microbatch size (sequences)")
    ap.add_argument("--steps", type=int, default=20, help="max_steps")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--corpus-bytes", type=int, default=2_000_000)
    ap.add_argument("--faults", default="[]", help="recover/adaptive: FaultInjection schedule (JSON list)")
    ap.add_argument("--rejoin", action="store_true", help="recover: hot re-join (replacements for lost replicas)")
    ap.add_argument("--rejoin-standbys", type=int, default=0, help="recover: recover.rejoin.standbys (warm standbys)")
    ap.add_argument("--salvage", action="store_true", help="recover: recover.salvage (a broken replica's live ranks wait as orphans)")
    ap.add_argument("--sdc-every", type=int, default=0, help="recover: silent-data-corruption check every N steps (0 = off)")
    ap.add_argument("--bucket-mb", type=float, default=None, help="recover: recover.bucket_mb (default: the strategy's)")
    ap.add_argument("--data-plane", default="mpi", help="recover: recover.data_plane (mpi, gloo)")
    ap.add_argument("--replica-plane", default="auto", help="recover: recover.replica_plane (auto, mpi, torch)")
    ap.add_argument("--mpi-wait", default=None, choices=["auto", "spin", "sleep"],
                    help="recover: LIGHTNING_RECOVER_MPI_WAIT (how MPI collectives wait; see lightning_recover/comm/mpi_wait.py)")
    ap.add_argument("--no-overlap", action="store_true", help="recover: recover.overlap=false (reduce after backward)")
    ap.add_argument("--sync-every-microbatch", action="store_true", help="recover: reduce-scatter inside a replica after every microbatch")
    ap.add_argument("--kills", default="[]", help='cr: JSON list of {"step": t, "rank": r}')
    ap.add_argument("--ckpt-every", type=int, default=0, help="cr: ModelCheckpoint(every_n_train_steps=N)")
    ap.add_argument("--record-loss", action="store_true", help="stock/cr: write the per-step global mean loss")
    ap.add_argument("--save-params", action="store_true",
                    help="recover: rank 0 writes the final parameters to params.pt (bitwise before/after comparisons)")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


class StepClock(Callback):
    """Rank 0: perf_counter at the end of every optimizer step (identical for every system).

    With ``out`` rank 0 also appends ``{"t": wall time, "step": global_step}`` to
    ``starts.jsonl`` when training starts, so a driver can tell each launch's start-up time.
    """

    def __init__(self, out: Path | None = None) -> None:
        self.out = out
        self.ends: list[tuple[int, float]] = []
        self.t_fit = 0.0
        self.wall_fit = 0.0
        self._last = -1

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.t_fit = time.perf_counter()
        self.wall_fit = time.time()
        self._last = trainer.global_step
        if self.out is not None and trainer.global_rank == 0:
            with open(self.out / "starts.jsonl", "a") as f:
                f.write(json.dumps({"t": self.wall_fit, "step": trainer.global_step, "wall_start": T_START}) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            self.ends.append((trainer.global_step, time.perf_counter()))

    def dump(self, path: Path, extra: dict) -> None:
        intervals = [b - a for (_, a), (_, b) in zip(self.ends, self.ends[1:])]
        first = self.ends[0][1] - self.t_fit if self.ends else None
        path.write_text(json.dumps({"steps": [s for s, _ in self.ends], "first_step_s": first, "intervals_s": intervals,
                                    "fit_s": (self.ends[-1][1] - self.t_fit) if self.ends else None,
                                    "wall_fit_start": self.wall_fit, "wall_end": time.time(), **extra}))


class _Counter(Dataset):
    """A stand-in train set: the stock/cr module fetches its microbatches by global id."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class StockGPT(GPT):
    """The example GPT with HSDP in configure_model and planner-driven data (same samples as ReCoVer)."""

    def __init__(self, *, data: ByteDataset, planner: MicrobatchPlanner, world: int, shards: int, grad_accum: int,
                 sync_every_microbatch: bool, record_loss: bool, out: Path | None, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kw)
        self._data, self._planner = data, planner
        self._world, self._shards, self._G = world, shards, grad_accum
        self._sync_every = sync_every_microbatch
        self._record_loss, self._out = record_loss, out
        self._mb = 0
        self._loss_sum = 0.0
        self._loss_n = 0
        self._fsdp = False

    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(self.trainer.strategy, ModelParallelStrategy) or isinstance(self, FSDPModule):
            return
        mesh = self.device_mesh  # ("data_parallel", "tensor_parallel"): 2-D mesh -> HSDP
        for blk in self.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(self, mesh=mesh)
        self._fsdp = True

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        rank = self.global_rank
        replica, shard = rank // self._shards, rank % self._shards
        k = self._mb % self._G
        self._mb += 1
        gid = self._planner.global_id(self.trainer.global_step, replica * self._G + k)
        torch.manual_seed(self._planner.rng_seed(gid, shard))
        samples = [self._data[i] for i in self._planner.sample_indices(gid, shard)]
        x, y = torch.utils.data.default_collate(samples)
        if self._fsdp and not self._sync_every:
            self.set_requires_gradient_sync(k == self._G - 1)  # type: ignore[attr-defined]
        loss = super().training_step((x, y), batch_idx)
        if self._record_loss:
            self._loss_sum += float(loss.detach())
            self._loss_n += 1
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if self._mb % self._G:
            return
        step = self.trainer.global_step - 1  # the step that just committed
        if self._record_loss:
            import torch.distributed as dist

            t = torch.tensor([self._loss_sum, float(self._loss_n)], dtype=torch.float64)
            dist.all_reduce(t)
            self._loss_sum, self._loss_n = 0.0, 0
            if self.global_rank == 0 and self._out is not None:
                with open(self._out / "loss.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "loss": float(t[0] / t[1]), "t": time.time()}) + "\n")


class KillAt(Callback):
    """cr: SIGKILL this rank in the backward of the first microbatch of step t, once (marker file)."""

    def __init__(self, kills: list[dict], out: Path) -> None:
        self.kills, self.out = kills, out

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # type: ignore[no-untyped-def]
        for i, k in enumerate(self.kills):
            if k["rank"] != trainer.global_rank or k["step"] != trainer.global_step or (pl_module._mb - 1) % pl_module._G:
                continue
            marker = self.out / f"kill{i}.marker"
            if marker.exists():
                continue
            with open(marker, "w") as f:
                f.write(json.dumps({"step": k["step"], "rank": k["rank"], "t": time.time()}))
                f.flush()
                os.fsync(f.fileno())
            print(f"[bench] SIGKILL rank {k['rank']} at step {k['step']}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def newest_checkpoint(ckdir: Path) -> str | None:
    """The checkpoint of the highest step in ``ckdir`` (the "last" one), or None."""
    def key(p: Path) -> tuple[int, float]:
        # ckpt-step=12.ckpt, or ckpt-step=12-v1.ckpt when a resumed run saves the same step again
        return int(re.match(r"ckpt-step=(\d+)", p.name).group(1)), p.stat().st_mtime  # type: ignore[union-attr]

    found = sorted(ckdir.glob("ckpt-step=*.ckpt"), key=key)
    return str(found[-1]) if found else None


def write_peak_rss(out: Path, rank: int) -> None:
    """This rank's peak resident memory so far (MiB), for the driver's memory comparison."""
    import resource

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    (out / f"rss{rank}.json").write_text(json.dumps({"rank": rank, "peak_rss_mib": peak_mib}))


def main() -> None:
    args = parse()
    if args.mpi_wait is not None:
        os.environ["LIGHTNING_RECOVER_MPI_WAIT"] = args.mpi_wait
    args.out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    L.seed_everything(args.seed, verbose=False)
    sizes = dict(SIZES[args.size])
    gpt_kw = dict(sizes, dropout=args.dropout, warmup_steps=2)
    data = ByteDataset(read_corpus(max_bytes=args.corpus_bytes), sizes["block_size"])
    clock = StepClock(args.out)
    common = dict(accelerator="cpu", max_steps=args.steps, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    extra: dict = {"system": args.system, "world": world, "shards": args.shards, "grad_accum": args.grad_accum,
                   "mbs": args.mbs, "size": args.size}

    if args.system in ("recover", "adaptive"):
        from lightning_recover.callbacks import FaultInjection
        from lightning_recover.strategies import ReCoVerHSDPStrategy

        model = GPT(**gpt_kw)
        strategy = ReCoVerHSDPStrategy(shards=args.shards, grad_accum=args.grad_accum,
                                       policy="static" if args.system == "recover" else "adaptive",
                                       ledger_path=args.out / "ledger.jsonl", seed=args.seed,
                                       rejoin=args.rejoin, rejoin_backoff_s=1.0, rejoin_standbys=args.rejoin_standbys, salvage=args.salvage,
                                       sdc_every_n_steps=args.sdc_every,
                                       overlap=not args.no_overlap, sync_every_microbatch=args.sync_every_microbatch,
                                       data_plane=args.data_plane, replica_plane=args.replica_plane,
                                       **({} if args.bucket_mb is None else {"bucket_mb": args.bucket_mb}))
        trainer = L.Trainer(devices=1, strategy=strategy, enable_checkpointing=False,
                            callbacks=[clock, FaultInjection(json.loads(args.faults))], **common)
        trainer.fit(model, DataLoader(data, batch_size=args.mbs))
        write_peak_rss(args.out, strategy.comm.rank if strategy.comm else 0)
        if args.save_params and trainer.global_rank == 0:
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, args.out / "params.pt")
        if trainer.global_rank == 0:
            clock.dump(args.out / "clock.json", {**extra, "rank": strategy.comm.rank if strategy.comm else 0,
                                                  "faults_seen": strategy.faults_seen, "wall_start": T_START})
        strategy.shutdown(exit_code=0)
        return

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    W = world // args.shards
    B = W * args.grad_accum
    planner = MicrobatchPlanner(len(data), B, args.mbs, shards=args.shards, seed=args.seed)
    model = StockGPT(data=data, planner=planner, world=world, shards=args.shards, grad_accum=args.grad_accum,
                     sync_every_microbatch=args.system == "stock-naive", record_loss=args.record_loss,
                     out=args.out, **gpt_kw)
    callbacks: list[Callback] = [clock]
    ckpt_path = None
    if args.system == "ddp":
        if args.shards != 1:
            raise SystemExit("ddp is plain replication: --shards must be 1")
        strategy = DDPStrategy(process_group_backend="gloo")
    elif args.system == "cr":
        if args.shards != 1:
            raise SystemExit("cr runs DDP: --shards must be 1")
        strategy = DDPStrategy(process_group_backend="gloo")
        ckdir = args.out / "ckpt"
        if args.ckpt_every:
            callbacks.append(ModelCheckpoint(dirpath=ckdir, every_n_train_steps=args.ckpt_every, save_top_k=2,
                                             monitor="step", mode="max", filename="ckpt-{step}"))
        callbacks.append(KillAt(json.loads(args.kills), args.out))
        ckpt_path = newest_checkpoint(ckdir)
    else:
        strategy = ModelParallelStrategy(data_parallel_size=W, tensor_parallel_size=args.shards)
    trainer = L.Trainer(devices=world, num_nodes=1, strategy=strategy, use_distributed_sampler=False,
                        accumulate_grad_batches=args.grad_accum, enable_checkpointing=args.system == "cr" and args.ckpt_every > 0,
                        callbacks=callbacks, **common)
    start_step = int(re.match(r"ckpt-step=(\d+)", Path(ckpt_path).name).group(1)) if ckpt_path else 0  # type: ignore[union-attr]
    trainer.fit(model, DataLoader(_Counter(args.grad_accum * 100_000), batch_size=1), ckpt_path=ckpt_path)
    write_peak_rss(args.out, trainer.global_rank)
    if trainer.global_rank == 0:
        clock.dump(args.out / f"clock{start_step}.json" if args.system == "cr" else args.out / "clock.json",
                   {**extra, "rank": 0, "resumed_from": start_step, "wall_start": T_START})
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Lightning's MPIEnvironment initialised MPI (mpi4py); the launch env turns mpi4py's
    # automatic finalize off, and a plain (non-ULFM) mpiexec treats a rank that exits
    # without MPI_Finalize as a failure, so finalize explicitly (no failure happened here).
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
