"""A LLaMA-architecture decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) with a tensor-parallel plan.

The paper's workload, in the shape a user brings it: a LightningModule whose
``configure_model`` applies, in torchtitan's order, tensor parallelism
(``parallelize_module`` on ``self.device_mesh["tensor_parallel"]``: ColwiseParallel on the
attention's and MLP's input projections, RowwiseParallel on their output projections),
activation checkpointing and ``torch.compile`` per block, then FSDP2 (``fully_shard`` per
block and on the root, over ``self.device_mesh["data_parallel"]``). The same module runs
under stock Lightning's ``ModelParallelStrategy`` and under ``strategy="recover_hsdp"``
with ``recover.tensor_parallel``; without a mesh (one process) it stays a plain module.

Sizes: ``tiny`` runs on a 2-core CPU with 4 ranks; ``1B`` (Llama-3.2-1B's shape, ~0.97B
parameters with a byte vocabulary) and ``7B`` (Llama-2-7B's shape) are for GPUs only.
The byte-level dataset of :mod:`model` feeds it (real text, no download).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    lr: float = 3e-3
    weight_decay: float = 0.0
    #: Recompute each block's activations in backward (applied in configure_model).
    activation_checkpointing: bool = False
    #: ``torch.compile`` each block with this backend ("inductor", "aot_eager", ...); None = eager.
    compile: str | None = None


LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32),
    # Llama-3.2-1B's shape (GQA 32/8, SwiGLU 8192) with a byte vocabulary: ~0.97B parameters.
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, max_seq_len=2048, rope_theta=500000.0),
    # Llama-2-7B's shape (no GQA, SwiGLU 11008): ~6.5B parameters with a byte vocabulary.
    "7B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008, max_seq_len=4096),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in fp32 (as LLaMA's reference code), returned in the input's dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's rotation angles, (seq_len, head_dim // 2) each (real tensors: no complex DTensors)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of ``x`` (batch, seq, heads, head_dim) by the position's angles."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention. Head counts are read from the projections' (local) widths, so the
    same code runs on a tensor-parallel rank's share of the heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        #: Recompute this block's activations in backward (set by configure_model).
        self.recompute = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # Inside the block's call: FSDP2's hooks on the block stay outside the recomputed region.
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def tensor_parallel_plan() -> dict[str, Any]:
    """torchtitan's plan for a block, without sequence parallelism: column-wise into attention and MLP,
    row-wise out of them (one all-reduce each in forward and backward)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


class Llama(L.LightningModule):
    """LLaMA decoder; ``training_step`` returns the mean token loss of its microbatch."""

    def __init__(self, cfg: LlamaConfig | dict[str, Any] | None = None, **overrides: Any) -> None:
        super().__init__()
        cfg = LlamaConfig(**cfg) if isinstance(cfg, dict) else (cfg or LlamaConfig())
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise TypeError(f"LlamaConfig has no field {k!r}; fields: {sorted(asdict(cfg))}")
            setattr(cfg, k, v)
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"dim={cfg.dim} must divide by n_heads={cfg.n_heads}, and n_heads by n_kv_heads={cfg.n_kv_heads}")
        self.cfg = cfg
        self.save_hyperparameters({"cfg": asdict(cfg)})
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def configure_model(self) -> None:
        """Tensor parallel, activation checkpointing, compile, FSDP2: what a ModelParallelStrategy user writes."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if any(isinstance(m, FSDPModule) for m in self.modules()):
            return  # configured by an earlier fit/validate of this module
        mesh = self.device_mesh
        names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            tp = mesh["tensor_parallel"].size()
            if self.cfg.n_kv_heads % tp:
                raise ValueError(f"n_kv_heads={self.cfg.n_kv_heads} must divide by the tensor-parallel size {tp}")
            for block in self.layers:
                parallelize_module(block, mesh["tensor_parallel"], tensor_parallel_plan())
        for i, block in enumerate(self.layers):
            block.recompute = self.cfg.activation_checkpointing
            if self.cfg.compile is not None:
                self.layers[i] = block = torch.compile(block, backend=self.cfg.compile)  # type: ignore[assignment]
        if "data_parallel" in names:
            dp_mesh = mesh["data_parallel"] if mesh.ndim > 1 else mesh
            for block in self.layers:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self, mesh=dp_mesh)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        self.log("train_loss", loss, on_step=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)


def parameter_count(cfg: LlamaConfig) -> int:
    """Parameters of a model of ``cfg`` (no instance needed: the 7B shape would not fit a test machine)."""
    head = cfg.dim // cfg.n_heads
    attn = cfg.dim * cfg.n_heads * head * 2 + cfg.dim * cfg.n_kv_heads * head * 2
    block = attn + 3 * cfg.dim * cfg.ffn_hidden + 2 * cfg.dim
    return cfg.n_layers * block + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers ``configure_model`` may add (``torch.compile``'s ``_orig_mod``)."""
    return name.replace("._orig_mod", "")


