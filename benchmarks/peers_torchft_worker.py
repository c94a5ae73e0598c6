"""torchft's side of ``benchmarks/peers.py``: one replica group's trainer, run under ``torchrun``.

Role: train the project's example GPT (``examples/model.py``) with torchft as its README and
``train_ddp.py`` run it, on the same data, microbatch, global batch and seed as the ReCoVer
jobs of ``benchmarks/bench_job.py``, and log every step it commits, with the sample
indices it consumed, so the driver can compare both systems from their own logs.

torchft pieces used (torchft-nightly / torchft 0.2, the ``peers`` extra): ``Manager`` with a
``ProcessGroupGloo(timeout=5 s)``, ``PGTransport`` to heal a restarted group from a live
peer, torchft's ``DistributedDataParallel`` (gradient all-reduce through the manager, the
average over the groups in the quorum) and ``OptimizerWrapper`` (``zero_grad`` starts the
quorum, ``step`` asks ``should_commit``), and torchft's ``DistributedSampler`` (the data set
sharded over ``NUM_REPLICA_GROUPS`` groups). Each group runs G microbatches per step
(``no_sync`` on all but the last, as DDP users accumulate), so a step of N groups in the
quorum applies N x G microbatches.

Environment (set by the driver): ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``,
``TORCHFT_LIGHTHOUSE``, and torchrun's ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``.

Outputs in ``--out``: ``progress.<group>.jsonl``, one line per step attempt of this group
(``committed`` true/false, the manager's ``step`` it committed, the group's mean microbatch
loss, ``participants`` in the quorum, ``participating`` (false while healing), the
lighthouse's ``quorum_id``, the sample
``indices`` of its microbatches, wall time ``t``); ``pid.<group>`` (this process's pid, for
the driver's SIGKILL: rewritten by every restart).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)  # as bench_job.py: one thread per rank, 4 ranks on a small machine

import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from examples.model import GPT, SIZES, ByteDataset, read_corpus  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, required=True, help="train until the manager has committed this many steps")
    ap.add_argument("--grad-accum", type=int, default=2, help="G: microbatches per group per step")
    ap.add_argument("--mbs", type=int, default=4, help="microbatch size (sequences)")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--corpus-bytes", type=int, default=2_000_000)
    ap.add_argument("--pg-timeout", type=float, default=5.0, help="ProcessGroupGloo timeout, seconds")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


class Indexed(Dataset):
    """The byte windows, each with its index, so every consumed sample is logged."""

    def __init__(self, data: ByteDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = self.data[i]
        return x, y, i


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import lightning as L
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pid.{group}").write_text(str(os.getpid()))

    # Same initial weights as bench_job.py's GPT (seed_everything, then the constructor).
    L.seed_everything(args.seed, verbose=False)
    sizes = dict(SIZES[args.size])
    model = GPT(**sizes, dropout=0.0, warmup_steps=2)
    data = Indexed(ByteDataset(read_corpus(max_bytes=args.corpus_bytes), sizes["block_size"]))
    sampler = DistributedSampler(data, replica_rank=group, num_replica_groups=groups, group_rank=0, num_replicas=1,
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.mbs, sampler=sampler)
    # The example GPT's optimizer and warm-up schedule (configure_optimizers), stepped by hand.
    cfg = model.configure_optimizers()
    inner, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict(), "sched": sched.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        sched.load_state_dict(sd["sched"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"peers_{group}", timeout=timedelta(seconds=10),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
    )
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        # First start: wait until every group's manager is up (heartbeating to the lighthouse).
        # Why: with --min_replicas 1 the groups that start first form a quorum of their own and
        # keep it (the lighthouse's fast quorum), and a late pair forms another: two trainings
        # with the same step numbers (seen here when imports finished 1-2 s apart). A cluster
        # job's groups start together; a restarted group (restart count > 0) must not wait.
        (args.out / f"ready.{group}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while sum(1 for g in range(groups) if (args.out / f"ready.{g}").exists()) < groups:
            if time.monotonic() > deadline:
                raise SystemExit(f"group {group}: not all {groups} replica groups started within 120 s (see their logs)")
            time.sleep(0.05)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)

    epoch = 0
    it = iter(loader)
    progress = open(args.out / f"progress.{group}.jsonl", "a", buffering=1)  # line-buffered: the driver tails it
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the (asynchronous) quorum for this step
        losses: list[float] = []
        indices: list[int] = []
        for k in range(args.grad_accum):
            try:
                x, y, idx = next(it)
            except StopIteration:  # the group's shard is used up: next epoch, as a data loader would
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(loader)
                x, y, idx = next(it)
            # Only the last microbatch's backward all-reduces (DDP's no_sync accumulates the others).
            with ddp.no_sync() if k < args.grad_accum - 1 else nullcontext():
                logits = ddp(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
                (loss / args.grad_accum).backward()
            losses.append(float(loss.detach()))
            indices += [int(i) for i in idx]
        participants = manager.num_participants()
        participating = manager.is_participating()
        # The lighthouse's id of the quorum this step ran in (private, no public accessor): two
        # quorums training side by side (a split brain) can have the same size, never the same id.
        quorum_id = getattr(manager, "_quorum_id", None)
        step = manager.current_step()
        optimizer.step()  # steps the inner optimizer only if should_commit() says the whole quorum succeeded
        committed = manager.current_step() > step
        if committed:
            sched.step()
        progress.write(json.dumps({"replica": group, "committed": committed, "step": step, "loss": sum(losses) / len(losses),
                                   "participants": participants, "participating": participating, "quorum_id": quorum_id,
                                   "indices": indices,
                                   "t": time.time()}) + "\n")
    progress.close()
    manager.shutdown(wait=False)
    sys.stdout.flush()
    # Exit without the interpreter's teardown: torchft's threads (quorum, heartbeats) can hold
    # it up after the lighthouse is gone, and the progress log is already complete.
    os._exit(0)


if __name__ == "__main__":
    main()
