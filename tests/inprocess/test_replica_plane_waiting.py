"""The replica plane's waits run inside the strategy's ``waiting`` context: waiting for a late mate is not being stuck."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lightning_recover.comm.replica_plane import MPIAllGather, MPIReduceScatter
from lightning_recover.runtime.watchdog import HangWatchdog
from lightning_recover.strategies.probes import StrategyProbes


def test_each_collective_waits_with_the_watchdog_progress_rule_paused(tmp_path) -> None:
    from mpi4py import MPI

    # The strategy's probes lower the watchdog's "computing" flag while a rank waits in MPI;
    # a recorder inside them notes what the flag was during each of the plane's waits.
    watchdog = HangWatchdog(0, 10.0, stuck_timeout=10.0, directory=tmp_path)
    watchdog.computing = True
    probes = StrategyProbes(0, watchdog, lambda: [])
    seen: list[bool] = []

    @contextlib.contextmanager
    def waiting() -> Iterator[None]:
        with probes.waiting():
            yield
            seen.append(watchdog.computing)

    gather, scatter = MPIAllGather(MPI.COMM_SELF, waiting), MPIReduceScatter(MPI.COMM_SELF, waiting)
    out = torch.empty(4)
    gather(out, torch.arange(4.0))
    scatter(out, torch.ones(4), op="SUM")
    assert torch.equal(out, torch.ones(4))
    assert seen == [False, False], "a wait for the mates ran as computing: a late mate would get this rank killed as stuck"
    assert watchdog.computing, "the flag is restored after the wait"


def test_without_a_context_the_plane_still_gathers() -> None:
    from mpi4py import MPI

    out = torch.empty(3)
    MPIAllGather(MPI.COMM_SELF)(out, torch.tensor([1.0, 2.0, 3.0]))
    assert out.tolist() == [1.0, 2.0, 3.0]
