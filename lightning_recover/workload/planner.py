"""Exactly-once microbatch planner: global microbatch ids -> dataset samples and RNG seeds.

Step t owns global ids t*B .. t*B+B-1. Whichever replica computes id m (its owner, a spare
shadowing it, or a survivor replaying it) reads the same samples and seeds its RNG the same
way, so the step's summed gradient does not depend on who computed what. That is what lets
a recovered run follow the fault-free loss trajectory exactly.

Samples come from a seeded permutation per data epoch; each of the `shards` ranks of a
replica reads its own disjoint slice of a microbatch. Pure Python + numpy, no torch.

A dataset of up to :attr:`MicrobatchPlanner.IN_MEMORY_LIMIT` samples draws each epoch's
permutation as an array (numpy's, every run so far). A larger one orders its samples with a
keyed bijection computed per sample (a Feistel network over the next power of four, cycle-
walked into range): an array of 10^9 samples would be 8 GB on every rank, and drawing it
O(dataset) per epoch, which at B = 10^6 microbatches comes back every few steps.
"""

from __future__ import annotations

import hashlib
import operator
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["MicrobatchPlanner"]

_STATE_VERSION = 1
_SEED_MASK = (1 << 63) - 1


def _int_arg(name: str, value: Any, minimum: int, fix: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}; {fix}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}; {fix}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}; {fix}")
    return v


_M64 = (1 << 64) - 1


def _feistel(x: int, half_bits: int, keys: tuple[int, ...]) -> int:
    """A keyed bijection of [0, 4**half_bits): balanced Feistel rounds with a 64-bit mixing function."""
    mask = (1 << half_bits) - 1
    left, right = x >> half_bits, x & mask
    for key in keys:
        v = right ^ key
        v = ((v ^ (v >> 31)) * 0x7FB5D329728EA185) & _M64
        v = ((v ^ (v >> 27)) * 0x81DADEF4BC2DD44D) & _M64
        v ^= v >> 33
        left, right = right, left ^ (v & mask)
    return (left << half_bits) | right


class MicrobatchPlanner:
    """Maps global microbatch ids to per-shard dataset indices and per-microbatch seeds."""

    # Permutations kept in memory: the current epoch and its neighbour at a boundary.
    CACHE_EPOCHS = 2
    #: Datasets larger than this are ordered per sample by a keyed bijection (see the module docstring).
    IN_MEMORY_LIMIT = 1 << 24

    def __init__(
        self,
        dataset_len: int,
        B: int,
        microbatch_size: int,
        shards: int = 1,
        seed: int = 0,
    ) -> None:
        self.dataset_len = _int_arg("dataset_len", dataset_len, 1, "pass len(train_dataset)")
        self.B = _int_arg("B", B, 1, "B = T * G_init must be a positive integer")
        self.microbatch_size = _int_arg(
            "microbatch_size", microbatch_size, 1, "set the dataloader batch_size to >= 1"
        )
        self.shards = _int_arg("shards", shards, 1, "pass the number of shard ranks per replica")
        self.seed = _int_arg("seed", seed, 0, "use a non-negative seed")
        # A microbatch spans all shard ranks of a replica.
        self.samples_per_microbatch = self.microbatch_size * self.shards
        need = self.B * self.samples_per_microbatch
        if self.dataset_len < need:
            raise ValueError(
                f"dataset has {self.dataset_len} samples but one step needs "
                f"B*microbatch_size*shards = {self.B}*{self.microbatch_size}*{self.shards} = "
                f"{need}; use a larger dataset or lower the batch size, grad_accum or T"
            )
        # The tail that does not fill a whole microbatch is dropped, so a microbatch never
        # straddles two epochs (and two permutations).
        self.microbatches_per_epoch = self.dataset_len // self.samples_per_microbatch
        self.samples_per_epoch = self.microbatches_per_epoch * self.samples_per_microbatch
        self.next_id = 0
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._keyed = self.dataset_len > self.IN_MEMORY_LIMIT
        self._keys: dict[int, tuple[int, ...]] = {}  # the bijection's round keys, per epoch
        # The bijection's domain: 2 * half bits, the smallest power of four holding the dataset,
        # so cycle-walking takes fewer than four rounds on average.
        self._half_bits = max(1, ((self.dataset_len - 1).bit_length() + 1) // 2)

    # -- ids ---------------------------------------------------------------------------

    def global_id(self, step: int, offset: int) -> int:
        step = _int_arg("step", step, 0, "pass the optimizer step index")
        offset = _int_arg("offset", offset, 0, f"offsets are step-local, in [0, {self.B})")
        if offset >= self.B:
            raise ValueError(
                f"offset must be < B={self.B}, got {offset}; offsets are step-local, "
                f"in [0, {self.B})"
            )
        return step * self.B + offset

    def step_ids(self, step: int) -> range:
        step = _int_arg("step", step, 0, "pass the optimizer step index")
        return range(step * self.B, (step + 1) * self.B)

    def data_epoch(self, mb_id: int) -> int:
        mb_id = _int_arg("mb_id", mb_id, 0, "microbatch ids are non-negative")
        return mb_id // self.microbatches_per_epoch

    @property
    def next_step(self) -> int:
        return self.next_id // self.B

    # -- samples and seeds -------------------------------------------------------------

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is not None:
            self._perms.move_to_end(epoch)
            return perm
        # SeedSequence mixes (seed, epoch), so neighbouring epochs get unrelated orders.
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)
        self._perms[epoch] = perm
        while len(self._perms) > self.CACHE_EPOCHS:
            self._perms.popitem(last=False)
        return perm

    def sample_indices(self, mb_id: int, shard: int) -> list[int]:
        """Dataset indices of shard `shard`'s slice of microbatch `mb_id`."""
        mb_id = _int_arg("mb_id", mb_id, 0, "microbatch ids are non-negative")
        shard = _int_arg("shard", shard, 0, f"shards are numbered 0..{self.shards - 1}")
        if shard >= self.shards:
            raise ValueError(
                f"shard must be < shards={self.shards}, got {shard}; "
                f"shards are numbered 0..{self.shards - 1}"
            )
        epoch, within = divmod(mb_id, self.microbatches_per_epoch)
        start = within * self.samples_per_microbatch + shard * self.microbatch_size
        if self._keyed:
            return self._keyed_order(epoch, start)
        perm = self._permutation(epoch)
        return perm[start : start + self.microbatch_size].tolist()

    def _keyed_order(self, epoch: int, start: int) -> list[int]:
        """The samples at positions start.. of ``epoch``'s order: a bijection of [0, dataset_len), O(1) per sample."""
        keys = self._keys.get(epoch)
        if keys is None:
            if len(self._keys) >= self.CACHE_EPOCHS:
                self._keys.pop(next(iter(self._keys)))
            drawn = np.random.default_rng([self.seed, epoch]).integers(0, 1 << 62, size=4, dtype=np.uint64)
            keys = self._keys[epoch] = tuple(int(k) for k in drawn)
        out = []
        for position in range(start, start + self.microbatch_size):
            x = _feistel(position, self._half_bits, keys)
            while x >= self.dataset_len:  # cycle-walk: a bijection of the domain stays one on [0, n)
                x = _feistel(x, self._half_bits, keys)
            out.append(x)
        return out

    def rng_seed(self, mb_id: int, shard: int = 0) -> int:
        """Deterministic 63-bit seed for microbatch `mb_id` on shard rank `shard`.

        Hashing (rather than seed + mb_id) keeps seeds of nearby ids and runs unrelated.
        """
        mb_id = _int_arg("mb_id", mb_id, 0, "microbatch ids are non-negative")
        shard = _int_arg("shard", shard, 0, "shards are numbered from 0")
        digest = hashlib.blake2b(
            f"lightning_recover:{self.seed}:{mb_id}:{shard}".encode(), digest_size=8
        ).digest()
        return int.from_bytes(digest, "little") & _SEED_MASK

    # -- progress and checkpointing ----------------------------------------------------

    @property
    def current_data_epoch(self) -> int:
        return self.data_epoch(self.next_id)

    def advance(self, step: int) -> None:
        """Record that `step` committed: the next id to train on is (step+1)*B."""
        step = _int_arg("step", step, 0, "pass the committed optimizer step index")
        next_id = (step + 1) * self.B
        if next_id < self.next_id:
            raise ValueError(
                f"advance({step}) would move next_id back from {self.next_id} to {next_id}; "
                f"steps commit in increasing order"
            )
        self.next_id = next_id

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "B": self.B,
            "microbatch_size": self.microbatch_size,
            "shards": self.shards,
            "dataset_len": self.dataset_len,
            "next_id": self.next_id,
            "data_epoch": self.current_data_epoch,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Resume at the saved next id; refuses state whose ids would map to other samples.

        microbatch_size and shards may change as long as their product (the samples of one
        microbatch) is unchanged: the microbatch's samples stay the same, only sliced anew.
        """
        for key in ("seed", "B", "dataset_len"):
            if d.get(key) != getattr(self, key):
                raise ValueError(
                    f"planner state has {key}={d.get(key)!r} but this run has "
                    f"{key}={getattr(self, key)}; resume with the checkpoint's {key} or "
                    f"microbatch ids would map to different samples"
                )
        saved = d.get("microbatch_size", 0) * d.get("shards", 0)
        if saved != self.samples_per_microbatch:
            raise ValueError(
                f"planner state has microbatch_size*shards = {d.get('microbatch_size')}*"
                f"{d.get('shards')} = {saved} samples per microbatch but this run has "
                f"{self.microbatch_size}*{self.shards} = {self.samples_per_microbatch}; keep "
                f"the per-microbatch sample count when resuming"
            )
        next_id = _int_arg("next_id", d.get("next_id"), 0, "the planner state is corrupt")
        if next_id % self.B:
            raise ValueError(
                f"planner state has next_id={next_id}, not a multiple of B={self.B}; "
                f"the planner state is corrupt"
            )
        self.next_id = next_id
