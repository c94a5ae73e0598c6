"""Launched training job for the strategy tests: tiny GPT, real corpus bytes, optional faults.

Every rank writes ``rank{R}.json`` (final parameters' checksum, its view of the run) and
``params{R}.pt`` (full parameters) into $LR_TEST_OUT; the leader writes the ledger.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_recover.callbacks import CorruptionCheck, FaultInjection, RecoveryCallback, resolve_ckpt_path  # noqa: E402
from lightning_recover.membership.seat import seat  # noqa: E402
from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402
from lightning_recover.workload.step_plan import PolicyError  # noqa: E402
from benchmarks.chaos import build_tiny  # noqa: E402  (benchmarks/chaos.py)
from lightning_recover.callbacks.loggers import LeaderCSVLogger  # noqa: E402


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--target", type=int, default=None)
    ap.add_argument("--policy", default="static")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--faults", default="[]")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--best-dir", default=None, help="also ModelCheckpoint(monitor=loss_synced, save_top_k=2, save_last=True) there")
    ap.add_argument("--unseeded", action="store_true", help="init weights differently on every rank")
    ap.add_argument("--alerts", action="store_true", help="record every recovery hook call in alerts{RANK}.jsonl")
    ap.add_argument("--pause", default=None, metavar="RANK:SECONDS", help="that rank sleeps after step 0 (slow, not stuck)")
    ap.add_argument("--num-workers", type=int, default=0, help="DataLoader(num_workers=...); loads are recorded under $LR_TEST_OUT/loads")
    ap.add_argument("--persistent-workers", action="store_true", help="DataLoader(persistent_workers=True)")
    ap.add_argument("--rejoin", action="store_true", help="hot re-join: replace lost replicas (backoff 0.5 s)")
    ap.add_argument("--sdc-every", type=int, default=1,
                    help="recover.sdc.every_n_steps (default 1: every run also counts as a false-positive check); 0 = off")
    ap.add_argument("--sdc-action", default="repair", help="recover.sdc.action")
    ap.add_argument("--rejoin-hosts", default=None, help="recover.rejoin.hosts")
    ap.add_argument("--salvage", action="store_true", help="recover.salvage: a broken replica's live ranks wait as orphans")
    ap.add_argument("--rejoin-attempts", type=int, default=3, help="recover.rejoin.attempts")
    ap.add_argument("--rejoin-timeout", type=float, default=60.0, help="recover.rejoin.timeout_s")
    ap.add_argument("--rejoin-standbys", type=int, default=0, help="recover.rejoin.standbys (warm standbys)")
    ap.add_argument("--rejoin-standbys-wait", type=float, default=60.0, help="recover.rejoin.standbys_wait_s")
    ap.add_argument("--replacement-exit", action="append", default=[], metavar="RANK:HOW:STATUS",
                    help="the replacement of RANK exits with STATUS as the script starts (a broken node): HOW=raise "
                    "is sys.exit(STATUS), HOW=hard is os._exit(STATUS) (no Python exit path runs)")
    ap.add_argument("--replica-group", action="store_true",
                    help="training_step runs torch.distributed collectives over strategy.replica_group once per step; "
                    "each rank writes what it got to collectives{RANK}.jsonl")
    ap.add_argument("--data-plane", default=os.environ.get("RECOVER_TEST_DATA_PLANE", "mpi"),
                    help="recover.data_plane (default: $RECOVER_TEST_DATA_PLANE, else mpi)")
    ap.add_argument("--replica-plane", default=os.environ.get("RECOVER_TEST_REPLICA_PLANE", "auto"),
                    help="recover.replica_plane (default: $RECOVER_TEST_REPLICA_PLANE, else auto)")
    ap.add_argument("--slow-while-degraded", type=float, default=0.0, metavar="SECONDS",
                    help="every rank sleeps this long after each step while replicas are missing (lets replacements start on 2 cores)")
    ap.add_argument("--slow-while-rejoining", type=float, default=0.0, metavar="SECONDS",
                    help="every rank sleeps this long after each step while the job still tries to re-join replicas")
    ap.add_argument("--no-overlap", action="store_true", help="recover.overlap=false")
    ap.add_argument("--sync-every-microbatch", action="store_true", help="recover.sync_every_microbatch=true")
    return ap.parse_args(argv)


class PauseAfterFirstStep(L.Callback):
    """Work between steps (a slow logger, a checkpoint) that must never count as stuck."""

    def __init__(self, spec: str) -> None:
        rank, seconds = spec.split(":")
        self.rank, self.seconds = int(rank), float(seconds)

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 1 and int(os.environ["OMPI_COMM_WORLD_RANK"]) == self.rank:
            time.sleep(self.seconds)


class SlowWhileDegraded(L.Callback):
    """Sleep after each step while fewer replicas than at launch are live: the 2-core test machine
    then has room for a replacement to import torch before the run is over."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        comm = trainer.strategy.comm  # type: ignore[attr-defined]
        if len(comm.alive_replicas) < comm.layout.replicas:
            time.sleep(self.seconds)


class SlowWhileRejoining(L.Callback):
    """Sleep after each step while the job will still try to bring replicas back (an attempt open or
    one to come): every attempt gets to run its course however slowly replacements start on a
    loaded 2-core machine, and the steps after the last attempt was given up run at full speed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        recruiter = trainer.strategy.recruiter  # type: ignore[attr-defined]
        if recruiter is not None and recruiter.active():
            time.sleep(self.seconds)


class LostReplicaAlert(RecoveryCallback):
    """A user's recovery callback: one line per lost replica as this rank saw it, and the hooks it got."""

    def __init__(self, out: Path) -> None:
        self.path = out / f"alerts{os.environ.get('OMPI_COMM_WORLD_RANK', '0')}.jsonl"
        self.committed: list[int] = []

    def _write(self, event: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")

    def on_world_repaired(self, trainer, pl_module, repair, step):  # type: ignore[no-untyped-def]
        for replica in repair.lost_replicas:
            self._write({"lost_replica": replica, "world_epoch": repair.world_epoch, "step": trainer.global_step,
                         "in_step": step is not None, "module": type(pl_module).__name__})

    def on_step_committed(self, trainer, pl_module, record, collectives):  # type: ignore[no-untyped-def]
        self._write({"committed": record["step"], "world_epoch": record["world_epoch"]})


class RecordedLoads(torch.utils.data.Dataset):
    """The user's dataset, leaving ``loads/PPID-PID`` the first time a process loads from it."""

    def __init__(self, dataset: torch.utils.data.Dataset, out: Path) -> None:
        self.dataset, self.out, self.seen = dataset, out, False

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        if not self.seen:  # once per process (a forked worker starts with its parent's False)
            self.seen = True
            (self.out / f"{os.getppid()}-{os.getpid()}").touch()
        return self.dataset[i]


class MarkWorker:
    """worker_init_fn: leaves ``inits/PPID-PID-ID``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __call__(self, worker_id: int) -> None:
        (self.out / f"{os.getppid()}-{os.getpid()}-{worker_id}").touch()


def replica_group_calls(strategy: ReCoVerHSDPStrategy, step: int, out: Path) -> None:
    """A user's cross-replica collectives, as a LightningModule would run them in training_step.

    Each replica contributes replica + 1 (and to the bf16 sum: 1.0 from replica 0, 2**-8 from
    the others, which only a float32 accumulation sums right). The call order is fixed: fault
    injection names a call by its index in the step (0 = the first all_reduce, 5 = all_gather)."""
    import torch.distributed as dist

    pg = strategy.replica_group
    mine = float(strategy.replica + 1)
    total = torch.tensor([mine, 2 * mine])
    dist.all_reduce(total, group=pg)
    top = torch.tensor([mine])
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=pg)
    low = torch.tensor([int(mine)], dtype=torch.int64)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=pg)
    mean = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=pg)
    half = torch.tensor([1.0 if strategy.replica == 0 else 2.0**-8], dtype=torch.bfloat16)
    dist.all_reduce(half, group=pg)
    rows = [torch.full((2,), -1.0) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(rows, torch.tensor([mine, -mine]), group=pg)
    sent = torch.tensor([mine])
    dist.broadcast(sent, group_src=min(1, dist.get_world_size(pg) - 1), group=pg)
    dist.barrier(group=pg)
    record = {
        "step": step, "sum": total.tolist(), "max": top.item(), "min": low.item(), "avg": mean.item(),
        "bf16": half.item(), "bf16_dtype": str(half.dtype), "gathered": [r.tolist() for r in rows], "bcast": sent.item(),
        "size": dist.get_world_size(pg), "rank": dist.get_rank(pg), "pg_rank": pg.rank(), "replicas": list(pg.replicas),
    }
    with open(out / f"collectives{strategy.comm.rank}.jsonl", "a") as f:  # type: ignore[union-attr]
        f.write(json.dumps(record) + "\n")


def dead_ranks_loaders(out: Path, alive: list[int], shards: int) -> list[int]:
    """Loader workers of ranks outside the live replicas that are still running (not even zombies)."""
    rank_pids = {int(f.name): int(f.read_text()) for f in (out / "rankpids").iterdir()}
    dead = {pid for rank, pid in rank_pids.items() if rank // shards not in alive}
    running = []
    for f in (out / "inits").iterdir():
        ppid, pid, _ = (int(x) for x in f.name.split("-"))
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if ppid in dead and state not in ("Z", "X"):
            running.append(pid)
    return running


def exit_at_start(specs: list[str]) -> None:
    """``--replacement-exit``: a replacement of a named rank ends before it could be admitted."""
    joining = seat()
    if joining is None:
        return
    for spec in specs:
        rank, how, status = spec.split(":")
        if int(rank) != joining.rank:
            continue
        # What the program sees of its world: the job's (the joiner sets it), never the spawn's.
        world = os.environ.get("OMPI_COMM_WORLD_SIZE")
        print(f"train_worker: replacement for rank {rank} (world {world}) exits with status {status} ({how})", file=sys.stderr, flush=True)
        if how == "hard":
            os._exit(int(status))
        sys.exit(int(status))


def main() -> None:
    args = parse()
    exit_at_start(args.replacement_exit)
    out = Path(os.environ["LR_TEST_OUT"])
    init_seed = args.seed + (int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) if args.unseeded else 0)
    model, data = build_tiny(init_seed)
    # Cross-replica metric sync: every rank counts its samples; the synced sum is the global count.
    from torchmetrics.aggregation import SumMetric

    model.samples_seen = SumMetric()
    original_step = model.training_step

    synced_step = [-1]

    def counting_step(batch, batch_idx):  # type: ignore[no-untyped-def]
        model.samples_seen.update(torch.tensor(float(batch[0].shape[0])))
        if args.replica_group and model.trainer.global_step != synced_step[0]:
            synced_step[0] = model.trainer.global_step  # once per step: the step's first microbatch
            replica_group_calls(strategy, model.trainer.global_step, out)
        loss = original_step(batch, batch_idx)
        model.log("loss_synced", loss, sync_dist=True, on_step=True)
        return loss

    model.training_step = counting_step  # type: ignore[method-assign]
    user_ckpt = []
    if args.best_dir:
        from lightning.pytorch.callbacks import ModelCheckpoint

        user_ckpt = [ModelCheckpoint(dirpath=args.best_dir, filename="best-{step:02d}", monitor="loss_synced", mode="min",
                                     save_top_k=2, every_n_train_steps=1, save_last=True, auto_insert_metric_name=False)]
    strategy = ReCoVerHSDPStrategy(
        shards=args.shards, grad_accum=args.grad_accum, target_replicas=args.target, policy=args.policy,
        ledger_path=out / "ledger.jsonl", seed=args.seed, bucket_mb=0.01, min_replicas=args.min_replicas,
        checkpoint_dir=args.ckpt_dir, checkpoint_every_n_steps=args.ckpt_every,
        rejoin=args.rejoin, rejoin_backoff_s=0.5, rejoin_timeout_s=args.rejoin_timeout, rejoin_hosts=args.rejoin_hosts,
        rejoin_attempts=args.rejoin_attempts, rejoin_standbys=args.rejoin_standbys,
        rejoin_standbys_wait_s=args.rejoin_standbys_wait, sdc_every_n_steps=args.sdc_every, sdc_action=args.sdc_action,
        salvage=args.salvage,
        overlap=not args.no_overlap, sync_every_microbatch=args.sync_every_microbatch,
        data_plane=args.data_plane, replica_plane=args.replica_plane,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, precision=args.precision,
        callbacks=[FaultInjection(json.loads(args.faults))] + ([PauseAfterFirstStep(args.pause)] if args.pause else [])
        + ([LostReplicaAlert(out)] if args.alerts else []) + user_ckpt
        + ([SlowWhileDegraded(args.slow_while_degraded)] if args.slow_while_degraded else [])
        + ([SlowWhileRejoining(args.slow_while_rejoining)] if args.slow_while_rejoining else []), logger=LeaderCSVLogger(out, name="logs"),
        enable_checkpointing=bool(user_ckpt), enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0, num_sanity_val_steps=0, log_every_n_steps=1,
    )
    ckpt = resolve_ckpt_path("last", args.ckpt_dir) if args.resume else None
    loader = DataLoader(data, batch_size=args.mbs)
    if args.num_workers:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        for sub in ("loads", "inits", "rankpids"):
            (out / sub).mkdir(exist_ok=True)
        (out / "rankpids" / rank).write_text(str(os.getpid()))
        loader = DataLoader(
            RecordedLoads(data, out / "loads"), batch_size=args.mbs, num_workers=args.num_workers,
            persistent_workers=args.persistent_workers, worker_init_fn=MarkWorker(out / "inits"),
        )
    try:
        trainer.fit(model, loader, ckpt_path=ckpt)
    except PolicyError as exc:
        print(f"train_worker: stopping: {exc}", file=sys.stderr, flush=True)
        strategy.shutdown(exit_code=3)
    comm = strategy.comm
    assert comm is not None
    with strategy.replica_guard("final parameter gather"):
        params = full_params(model)
    if comm.shard == 0:
        torch.save(params, out / f"params{comm.rank}.pt")
    result = {
        "rank": comm.rank, "replica": comm.replica, "epoch": comm.world_epoch, "alive": list(comm.alive_replicas),
        "global_step": trainer.global_step, "leader": strategy.global_rank == 0, "last": strategy.last_record,
        "samples_seen": float(model.samples_seen.compute()),
        # The final world epoch's data plane: which one, and how many buckets it carried.
        "data_plane": comm.data_plane.kind if comm.data_plane else None,
        "data_plane_buckets": comm.data_plane.reductions if comm.data_plane else 0,
        # What carried FSDP2's collectives inside the replica, and how many ran on MPI.
        "replica_plane": strategy.replica_plane,
        "replica_plane_calls": strategy.replica_plane_calls,
    }
    sdc = [cb for cb in trainer.callbacks if isinstance(cb, CorruptionCheck)]
    if sdc:
        result.update(sdc_checks=sdc[0].checks, sdc_detections=sdc[0].detections)
    if user_ckpt:
        cb = user_ckpt[0]
        result["best_model_path"], result["last_model_path"] = cb.best_model_path, cb.last_model_path
        result["best_k_models"] = {k: float(v) for k, v in cb.best_k_models.items()}
    if args.num_workers:
        assert strategy.feed is not None
        result.update(pid=os.getpid(), feed=strategy.feed.stats._asdict(),
                      dead_ranks_loaders=dead_ranks_loaders(out, list(comm.alive_replicas), args.shards))
    (out / f"rank{comm.rank}.json").write_text(json.dumps(result))
    strategy.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
