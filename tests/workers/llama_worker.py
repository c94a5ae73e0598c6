"""Launched job for the LLaMA tests: the example's tiny LLaMA (or a Hugging Face ``LlamaForCausalLM``),
tensor parallel and FSDP2 inside each replica, optional activation checkpointing, compile and faults.

The LightningModule's ``configure_model`` does what a ``ModelParallelStrategy`` user writes
(``parallelize_module`` on ``self.device_mesh["tensor_parallel"]``, ``fully_shard`` on
``self.device_mesh["data_parallel"]``). Every rank writes ``rank{R}.json`` (what it saw: its
mesh, its parameters' placements); rank 0 of each surviving replica's data-parallel and
tensor-parallel index 0 writes ``params{R}.pt`` (full parameters); the leader writes the ledger.
:func:`reference_run` is the single process the launched runs must match.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from examples.llama import LLAMA_SIZES, Llama, canonical_name  # noqa: E402
from examples.model import ByteDataset, read_corpus  # noqa: E402

CORPUS_BYTES = 100_000
#: Held-out windows for --validate: the corpus bytes after the training ones.
VAL_SAMPLES = 16


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("llama", "hf"), default="llama", help="the example's LLaMA or transformers' LlamaForCausalLM")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--faults", default="[]")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing on every block (configure_model)")
    ap.add_argument("--compile", default=None, help="torch.compile every block with this backend (configure_model)")
    ap.add_argument("--replica-plane", default="auto")
    ap.add_argument("--ckpt-dir", default=None, help="recover.checkpoint.dir (every --ckpt-every steps)")
    ap.add_argument("--ckpt-every", type=int, default=1)
    ap.add_argument("--resume", action="store_true", help="fit from the newest checkpoint in --ckpt-dir")
    ap.add_argument("--validate", action="store_true", help="after fit, trainer.validate() on VAL_SAMPLES held-out windows")
    ap.add_argument("--sdc-every", type=int, default=0, help="recover.sdc.every_n_steps (0: off, the default here)")
    ap.add_argument("--rejoin", action="store_true", help="hot re-join (backoff 0.5 s); each step sleeps 1 s while a replica is lost")
    return ap.parse_args(argv)


class HFLlama(L.LightningModule):
    """A randomly initialised ``transformers.LlamaForCausalLM`` (no download), tensor-parallel like the example."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        tiny = LLAMA_SIZES["tiny"]
        cfg = LlamaConfig(
            vocab_size=256, hidden_size=tiny["dim"], intermediate_size=tiny["ffn_hidden"], num_hidden_layers=tiny["n_layers"],
            num_attention_heads=tiny["n_heads"], num_key_value_heads=tiny["n_kv_heads"], max_position_embeddings=tiny["max_seq_len"],
            attention_dropout=0.0, tie_word_embeddings=False,
        )
        cfg._attn_implementation = "sdpa"
        self.lr = lr
        self.hf = LlamaForCausalLM(cfg)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if any(isinstance(m, FSDPModule) for m in self.modules()):
            return
        mesh = self.device_mesh
        if mesh is None:
            return
        plan = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(), "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        if "tensor_parallel" in (mesh.mesh_dim_names or ()):
            for layer in self.hf.model.layers:
                parallelize_module(layer, mesh["tensor_parallel"], plan)
        dp_mesh = mesh["data_parallel"] if mesh.ndim > 1 else mesh
        for layer in self.hf.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # Through the LightningModule's own call: FSDP2's root unit (this module) gathers the
        # embedding and the head in its forward hook.
        return self.hf(input_ids=idx).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class SlowWhileDegraded(L.Callback):
    """Sleep a second after each step while a replica is lost: a replacement has time to import torch on 2 cores."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        comm = trainer.strategy.comm  # type: ignore[attr-defined]
        if len(comm.alive_replicas) < comm.layout.replicas:
            time.sleep(1.0)


def build(args: argparse.Namespace) -> tuple[L.LightningModule, ByteDataset]:
    """The model and dataset, seeded identically in every process and in the reference."""
    L.seed_everything(args.seed, verbose=False)
    if args.model == "hf":
        model: L.LightningModule = HFLlama()
    else:
        model = Llama(**LLAMA_SIZES["tiny"], activation_checkpointing=args.ac, compile=args.compile)
    return model, ByteDataset(read_corpus(max_bytes=CORPUS_BYTES), LLAMA_SIZES["tiny"]["max_seq_len"])


def validation_set() -> ByteDataset:
    """VAL_SAMPLES windows of the corpus bytes that follow the training set's."""
    seq = LLAMA_SIZES["tiny"]["max_seq_len"]
    corpus = read_corpus(max_bytes=CORPUS_BYTES + VAL_SAMPLES * seq + 1)
    return ByteDataset(corpus[CORPUS_BYTES:], seq)


def validation_loss(params: dict[str, torch.Tensor], argv: list[str]) -> float:
    """The mean token loss over the validation set of a one-process model holding ``params``."""
    model, _ = build(parse(argv))
    model.load_state_dict(params)
    data = validation_set()
    with torch.no_grad():
        losses = [float(nn.functional.cross_entropy(model(x[None]).reshape(-1, 256).float(), y)) for x, y in data]
    return sum(losses) / len(losses)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[canonical_name(name)] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def reference_run(argv: list[str], replicas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process accumulating the same B microbatches per step (``mbs x data-parallel ranks`` samples each)."""
    from lightning_recover.workload.planner import MicrobatchPlanner

    args = parse(argv)
    model, data = build(args)
    dp = args.shards // args.tp
    B = replicas * args.grad_accum
    planner = MicrobatchPlanner(len(data), B, args.mbs * dp, shards=1, seed=args.seed)
    opt = model.configure_optimizers()
    model.log = lambda *a, **k: None  # type: ignore[method-assign]
    losses = []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for offset in range(B):
            idx = planner.sample_indices(planner.global_id(step, offset), 0)
            batch = (torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx]))
            loss = model.training_step(batch, 0)
            (loss / B).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total / B)
    return losses, full_params(model)


def main() -> None:
    from lightning_recover.callbacks import CorruptionCheck, FaultInjection, resolve_ckpt_path
    from lightning_recover.strategies import ReCoVerHSDPStrategy

    args = parse()
    out = Path(os.environ["LR_TEST_OUT"])
    model, data = build(args)
    strategy = ReCoVerHSDPStrategy(
        shards=args.shards, tensor_parallel=args.tp, grad_accum=args.grad_accum, seed=args.seed, ledger_path=out / "ledger.jsonl",
        bucket_mb=0.01, replica_plane=args.replica_plane, sdc_every_n_steps=args.sdc_every,
        # The first step compiles each block (tens of seconds on a loaded 2-core machine), without progress ticks.
        stuck_timeout_s=600.0 if args.compile else None,
        **({"checkpoint_dir": args.ckpt_dir, "checkpoint_every_n_steps": args.ckpt_every} if args.ckpt_dir else {}),
        **({"rejoin": True, "rejoin_backoff_s": 0.5} if args.rejoin else {}),
    )
    callbacks: list[L.Callback] = [FaultInjection(json.loads(args.faults))] + ([SlowWhileDegraded()] if args.rejoin else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    ckpt = resolve_ckpt_path("last", args.ckpt_dir) if args.resume else None
    trainer.fit(model, DataLoader(data, batch_size=args.mbs), ckpt_path=ckpt)
    validated = trainer.validate(model, DataLoader(validation_set(), batch_size=args.mbs), verbose=False) if args.validate else None
    comm = strategy.comm
    assert comm is not None
    mesh = strategy.device_mesh
    with strategy.replica_guard("final parameter gather"):
        params = full_params(model)
    if comm.shard == 0:
        torch.save(params, out / f"params{comm.rank}.pt")
    placements: dict[str, Any] = {
        canonical_name(n): [str(pl) for pl in p.placements] for n, p in model.named_parameters() if hasattr(p, "placements")
    }
    result = {
        "rank": comm.rank, "replica": comm.replica, "shard": comm.shard, "alive": list(comm.alive_replicas),
        "global_step": trainer.global_step, "mesh": {"names": list(mesh.mesh_dim_names or ()), "shape": list(mesh.shape)},
        "tp_index": mesh.get_local_rank("tensor_parallel") if mesh.ndim > 1 else 0,
        "dp_index": mesh.get_local_rank("data_parallel"),
        "placements": placements, "replica_plane": strategy.replica_plane, "replica_plane_calls": strategy.replica_plane_calls,
        "compiled": sum("OptimizedModule" in type(m).__name__ for m in model.modules()),
        "recompute": sum(bool(getattr(m, "recompute", False)) for m in model.modules()),
        "validate": validated,
    }
    sdc = [cb for cb in trainer.callbacks if isinstance(cb, CorruptionCheck)]
    result |= {
        "sdc_checks": sdc[0].checks if sdc else 0, "sdc_detections": sdc[0].detections if sdc else 0,
    }
    (out / f"rank{comm.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
