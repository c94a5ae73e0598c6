"""Simulated gradients and losses of the step engine's FakeWorld suites (tests/inprocess/test_engine*.py).

The recovery protocol is checked bit for bit: every gradient is an integer-valued float64
tensor derived from ``(step, microbatch, shard)``, so every sum is exact and a missing or
doubled microbatch shows in the result. The suites share these definitions so that the
re-join runs compare with the plain step-engine runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_recover.audit.ledger import MembershipTable, microbatch_ids

#: Two gradient tensors; with BUCKET_NUMEL=2 they make NB=4 buckets, one of them shared.
SIZES = (5, 3)
BUCKET_NUMEL = 2
#: Every rendezvous gives up after this long: a hang fails the test instead of blocking it.
TIMEOUT_S = 10.0


def grad_of(step: int, mb: int, shard: int) -> list[torch.Tensor]:
    """The gradient of step-local microbatch ``mb``: small integers, so float64 sums are exact."""
    gen = torch.Generator().manual_seed(step * 100_003 + mb * 17 + shard)
    return [torch.randint(-64, 65, (n,), generator=gen).to(torch.float64) for n in SIZES]


def loss_of(step: int, mb: int) -> float:
    return float((step * 31 + mb * 7) % 97)


class FullRecords:
    """One rank's committed records in the ledger's full form: its replicas, roles and every id.

    The engine hands out compact records (ranges, a membership line); the suites assert on
    the full form, resolved the way a ledger reader does it, so the reader is tested too."""

    def __init__(self) -> None:
        self._table = MembershipTable()

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        full = self._table.resolve(record)
        full["microbatch_ids"] = microbatch_ids(record)
        return full
