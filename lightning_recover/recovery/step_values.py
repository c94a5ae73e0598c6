"""Values logged inside a step, summed exactly once per microbatch across the live replicas.

What a user logs with ``sync_dist=True`` inside ``training_step`` is produced per
*microbatch*, and how many microbatches a rank computes in a step depends on the plan
(spares shadow, survivors replay a lost replica's ids). A collective per logged value is
therefore not the same on every rank; the one point every rank reaches is the step's
commit. So the runner records, per step-local microbatch id, a few numbers per logged key
(:data:`FIELDS`), and the engine sums them in the commit's reduction over the microbatches
each replica *owns* (a spare's shadow copies and a discarded accumulator count zero) --
the same exactly-once rule as the step loss.

Two reductions, both SUM over every live rank: a fixed-size header (the loss, and a
fingerprint of the logged keys that must agree on every rank, else the payload sizes would
differ), then the payload. Pure Python + torch tensors, no MPI.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence

import torch

from lightning_recover.errors import RecoverError

#: Per key and microbatch: the value and a count for the step value (``on_step``), and the
#: increments of Lightning's epoch accumulators (``on_epoch``: value * batch size and batch
#: size for a mean, the value for a sum).
FIELDS = ("step_sum", "step_count", "epoch_value", "epoch_weight")
Values = tuple[float, float, float, float]


class LoggedKeysMismatch(RecoverError, RuntimeError):
    """Ranks logged different keys with ``sync_dist=True`` in the same step."""


def keys_of(logged: Mapping[int, Mapping[str, Values]]) -> list[str]:
    """Every key this rank logged in the step, in the order every rank uses."""
    return sorted({k for per_offset in logged.values() for k in per_offset})


def header(loss_sum: float, loss_count: float, keys: Sequence[str], votes: Sequence[float] = ()) -> torch.Tensor:
    """``[loss_sum, loss_count, 1 (counts ranks), crc32(keys), len(keys), *votes]`` for the first reduction.

    ``votes`` are the callbacks' per-rank numbers (:attr:`StepState.votes`, in key order),
    summed over every live rank in the same reduction: a uniform decision at no extra cost.
    """
    return torch.tensor([loss_sum, loss_count, 1.0, _fingerprint(keys), float(len(keys)), *votes], dtype=torch.float64)


def _fingerprint(keys: Sequence[str]) -> float:
    return float(zlib.crc32("\n".join(keys).encode())) if keys else 0.0


def check_header(reduced: torch.Tensor, keys: Sequence[str]) -> None:
    """Every rank logged the same keys (their fingerprints summed to ranks x this rank's)."""
    ranks = float(reduced[2])  # the votes follow the fixed fields and are not checked here
    if float(reduced[3]) != _fingerprint(keys) * ranks or float(reduced[4]) != float(len(keys)) * ranks:
        raise LoggedKeysMismatch(
            f"self.log(..., sync_dist=True) inside training_step logged {list(keys)} on this rank but other keys on "
            "another rank in the same step; log the same names on every rank in every step (e.g. do not make a "
            "synced self.log call depend on the data), or log that value without sync_dist"
        )


def payload(logged: Mapping[int, Mapping[str, Values]], owned: Iterable[int], keys: Sequence[str]) -> torch.Tensor:
    """The sums over the owned microbatches, ``len(FIELDS)`` numbers per key, keys in ``keys`` order."""
    out = torch.zeros(len(keys) * len(FIELDS), dtype=torch.float64)
    index = {k: i for i, k in enumerate(keys)}
    for offset in owned:
        for key, values in logged.get(offset, {}).items():
            base = index[key] * len(FIELDS)
            for j, v in enumerate(values):
                out[base + j] += v
    return out


def unpack(reduced: torch.Tensor, keys: Sequence[str]) -> dict[str, Values]:
    """The reduced payload, per key."""
    n = len(FIELDS)
    return {k: tuple(float(x) for x in reduced[i * n : (i + 1) * n]) for i, k in enumerate(keys)}  # type: ignore[misc]
