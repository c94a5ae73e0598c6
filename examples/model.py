"""A GPT-style decoder and a byte-level language-modelling dataset (real text, no download).

Used by ``examples/pretrain.py`` and by the tests. Sizes go from ``tiny`` (a few seconds a
step on a 2-core CPU with 4 ranks) to ~100M parameters for GPUs.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.1
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 5


SIZES = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=32),
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "base": dict(n_layer=12, n_head=12, n_embd=768, block_size=512),  # ~100M with a byte vocab
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.MultiheadAttention(cfg.n_embd, cfg.n_head, dropout=cfg.dropout, bias=False, batch_first=True)
        # No attention biases: the key bias has an identically zero gradient (softmax is
        # shift-invariant), so Adam would turn its rounding noise into real updates.
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """Decoder-only transformer; ``training_step`` returns the mean token loss of its microbatch."""

    def __init__(self, cfg: GPTConfig | dict[str, object] | None = None, **overrides: object) -> None:
        super().__init__()
        # load_from_checkpoint passes the saved hyper-parameters back: cfg as a dict.
        cfg = GPTConfig(**cfg) if isinstance(cfg, dict) else (cfg or GPTConfig())
        for k, v in overrides.items():
            setattr(cfg, k, v)
        self.cfg = cfg
        self.save_hyperparameters({"cfg": cfg.__dict__})
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        mask = torch.triu(torch.full((cfg.block_size, cfg.block_size), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        return self.head(self.ln_f(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        warm = max(1, self.cfg.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def stdlib_corpus() -> Path:
    """The running interpreter's standard library: real text present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(path: str | os.PathLike[str] | None = None, max_bytes: int = 4_000_000) -> bytes:
    """Bytes of a text file, or of the ``*.py``/``*.txt``/``*.md`` files under a directory (sorted, capped)."""
    root = Path(path) if path is not None else stdlib_corpus()
    if not root.exists():
        raise FileNotFoundError(f"corpus path {str(root)!r} does not exist; set data.corpus to a text file or directory")
    if root.is_file():
        return root.read_bytes()[:max_bytes]
    chunks, total = [], 0
    for f in _text_files(root):
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no text files (*.py, *.txt, *.md, *.rst) under {str(root)!r}; set data.corpus")
    return b"\n".join(chunks)[:max_bytes]


#: What a corpus directory contributes, and the directories it skips (installed packages, test suites).
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}
SKIPPED_DIRS = {"site-packages", "test"}


def _text_files(root: Path) -> Iterator[Path]:
    """The text files under ``root`` in ``sorted()`` order of their paths, lazily.

    Walking one directory at a time in name order yields the same order as sorting every path
    (paths compare part by part), without listing the skipped directories (the stdlib's
    site-packages holds most of its files) and stopping as soon as the caller has enough:
    every rank, and every re-join replacement, reads the corpus at start-up.
    Symlinked directories are not entered (as ``Path.rglob``)."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        path = Path(e.path)
        if e.is_dir():
            if not e.is_symlink() and e.name not in SKIPPED_DIRS:
                yield from _text_files(path)
        elif path.suffix in TEXT_SUFFIXES and path.is_file():
            yield path


class ByteDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: (input, next-byte target)."""

    def __init__(self, data: bytes, block_size: int) -> None:
        if len(data) < block_size + 1:
            raise ValueError(f"corpus has {len(data)} bytes, fewer than one window of {block_size + 1}")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.block = block_size
        self.n = (len(data) - 1) // block_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        chunk = self.data[i * self.block : i * self.block + self.block + 1].long()
        return chunk[:-1], chunk[1:]


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
