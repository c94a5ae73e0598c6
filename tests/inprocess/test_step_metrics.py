"""torchmetrics states through the commit (issue 34, point 1), on two simulated ranks.

The engine's part (summing each microbatch's numbers over the owned microbatches of every
live rank) is replaced by a plain sum here; what is held to its contract is the strategy's
bookkeeping: increments captured per microbatch, a shadow microbatch left out, the totals
on the world's rank 0 (zero elsewhere) so that the metric's own sync gives the fault-free
value, and the totals moving to a new rank 0 when the world changes. The launched runs with
kills are ``tests/launched/test_user_epoch_mpi.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torchmetrics

from lightning_recover.strategies.step_metrics import StepMetrics


class Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = torchmetrics.MeanMetric()
        self.ppl = torchmetrics.text.Perplexity()


def sync_compute(modules: list[Module], name: str) -> float:
    """What the metric's epoch-end compute gives with its states summed over the ranks (its dist_reduce_fx)."""
    total = getattr(modules[0], name).__class__() if name == "mean" else torchmetrics.text.Perplexity()
    for state in getattr(modules[0], name).metric_state:
        setattr(total, state, sum(getattr(getattr(m, name), state) for m in modules))
    total._update_count = 1
    return float(total.compute())


def microbatch(book: StepMetrics, module: Module, loss: float, logits: torch.Tensor, target: torch.Tensor) -> dict:
    book.start(module)
    module.mean.update(torch.tensor(loss))
    module.ppl.update(logits, target)
    return book.capture(module)


def add(*captures: dict) -> dict:
    out: dict = {}
    for c in captures:
        for k, v in c.items():
            out[k] = tuple(a + b for a, b in zip(out.get(k, (0.0,) * 4), v))
    return out


def test_totals_sum_the_owned_microbatches_and_live_on_rank_0_then_move() -> None:
    torch.manual_seed(0)
    logits, target = torch.randn(4, 1, 3, 5), torch.randint(0, 5, (4, 1, 3))
    losses = [2.0, 3.0, 5.0, 7.0]
    reference = Module()
    for i in range(4):
        reference.mean.update(torch.tensor(losses[i]))
        reference.ppl.update(logits[i], target[i])
    ranks, books = [Module(), Module()], [StepMetrics(), StepMetrics()]
    # Step 0: rank 0 owns microbatches 0, 1; rank 1 owns 2 and shadows 0 (a spare's copy: not owned).
    for book, m in zip(books, ranks):
        book.begin_step(m)
    owned = [microbatch(books[0], ranks[0], losses[i], logits[i], target[i]) for i in (0, 1)]
    owned.append(microbatch(books[1], ranks[1], losses[2], logits[2], target[2]))
    microbatch(books[1], ranks[1], losses[0], logits[0], target[0])  # the shadow, left out of the sum
    totals = add(*owned)
    for r, (book, m) in enumerate(zip(books, ranks)):
        book.apply(m, totals, leader=r == 0)
    assert float(ranks[1].mean.mean_value) == 0.0 and float(ranks[0].mean.mean_value) == 10.0
    # Step 1: rank 0 was lost; rank 1 is the new rank 0 and computes microbatch 3.
    books[1].rehome(ranks[1], leader=True)
    books[1].begin_step(ranks[1])
    books[1].apply(ranks[1], microbatch(books[1], ranks[1], losses[3], logits[3], target[3]), leader=True)
    assert sync_compute([ranks[1]], "mean") == pytest.approx(float(reference.mean.compute()), rel=1e-6)
    assert sync_compute([ranks[1]], "ppl") == pytest.approx(float(reference.ppl.compute()), rel=1e-6)


def test_a_metric_not_updated_in_training_steps_is_left_alone() -> None:
    book, m = StepMetrics(), Module()
    m.mean.update(torch.tensor(4.0))  # e.g. in validation_step: this rank's own part
    book.begin_step(m)
    book.start(m)
    book.apply(m, book.capture(m), leader=False)  # a training microbatch that did not touch it
    assert float(m.mean.mean_value) == 4.0


def test_a_state_that_cannot_be_summed_is_named_in_a_warning() -> None:
    class WithCat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cat = torchmetrics.CatMetric()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        StepMetrics().begin_step(WithCat())
    assert [w for w in seen if "torchmetrics cat:" in str(w.message) and "not recovered after a lost replica" in str(w.message)]


def test_a_replacement_takes_the_totals_over_and_can_lead_with_them() -> None:
    torch.manual_seed(1)
    logits, target = torch.randn(3, 1, 3, 5), torch.randint(0, 5, (3, 1, 3))
    losses = [2.0, 3.0, 5.0]
    reference = Module()
    for i in range(3):
        reference.mean.update(torch.tensor(losses[i]))
        reference.ppl.update(logits[i], target[i])
    donor, book = Module(), StepMetrics()
    book.begin_step(donor)
    book.apply(donor, add(*(microbatch(book, donor, losses[i], logits[i], target[i]) for i in (0, 1))), leader=True)
    handed = book.totals(donor)
    assert set(handed) == {"mean.mean_value", "mean.weight", "ppl.total_log_probs", "ppl.count"}
    # The replacement joins as a non-leader (zero states), then every survivor is lost: it leads with the totals.
    joined, its_book = Module(), StepMetrics()
    its_book.take_over(joined, handed, leader=False)
    assert float(joined.mean.weight) == 0.0
    its_book.rehome(joined, leader=True)
    its_book.begin_step(joined)
    its_book.apply(joined, microbatch(its_book, joined, losses[2], logits[2], target[2]), leader=True)
    assert sync_compute([joined], "mean") == pytest.approx(float(reference.mean.compute()), rel=1e-6)
    assert sync_compute([joined], "ppl") == pytest.approx(float(reference.ppl.compute()), rel=1e-6)
