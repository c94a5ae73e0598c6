"""The run behind tests/data/ledger_before_compact.jsonl, written again with today's code.

That fixture was written by the code of d097eaf (full ledger lines) for a 4-replica
StaticWorld run with a spare (T=3, G_init=2): a loss the spare absorbs (step 3), a replayed
loss (step 6) and a re-join (after step 7). :func:`write_fixture_run` writes the same run's
ledger as the package writes it now, so the suites can hold the two formats to one meaning.
"""

from __future__ import annotations

from pathlib import Path

from lightning_recover.audit.ledger_writer import LedgerWriter
from lightning_recover.workload.static_world import StaticWorld

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "ledger_before_compact.jsonl"


def write_fixture_run(path: Path) -> None:
    pol = StaticWorld(4, 2, T=3)
    alive: tuple[int, ...] = (0, 1, 2, 3)
    with LedgerWriter(path) as out:
        for step in range(10):
            pol.begin_step(step, alive)
            if step == 3:
                pol.fail([0])
            if step == 6:
                pol.fail([1])
            commit = pol.commit()
            rec = commit.as_dict()
            rec.update(loss=1.0 / (step + 1), world_epoch=int(step >= 3) + int(step >= 6), step_time_s=0.01, recovery_s=0.0,
                       policy="static", divisor=commit.B)
            out.write(rec)
            alive = commit.replicas
            if step == 7:
                pol.join([0])
                alive = tuple(sorted((*alive, 0)))
