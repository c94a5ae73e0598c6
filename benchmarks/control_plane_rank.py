"""One rank of a ``benchmarks/control_plane.py`` job: the real step engine over ULFM, its MPI calls counted.

Contract: launched by ``control_plane.py`` through ``lightning-recover launch -n N`` (i.e.
``mpiexec --with-ft ulfm``). Every rank is one replica (one shard) running the package's
own recovery layer as the strategy drives it, without Lightning: a
:class:`~lightning_recover.comm.communicator.FaultTolerantComm`, the ``static`` policy
(``make_policy``, T = N: no spares, so a loss is a boundary step whose ids the survivors
replay), a :class:`~lightning_recover.recovery.engine.StepEngine` with the recovery
callbacks (ReductionBuffers, EpochCheck, BoundaryScheduler), and a tiny MLP whose gradients
are reduced in several buckets. Before the communicator exists,
:func:`mpi_counter.install` makes every MPI communicator count its calls (see
``mpi_counter.py``); the rank then records, per phase:

* ``startup``: building the communicator (its world duplicate, shard split, the rows every
  rank gathers once);
* ``steady``: each of ``--steps`` fault-free steps, one tally per step (a first step before
  them is not counted, nor is anything between steps);
* ``faulty``: the step in which rank ``--victim`` SIGKILLs itself (``os.kill``, a real
  process death) before bucket ``--kill-at-bucket`` of the reduction, from ``begin`` to the
  commit on every survivor: the failed round, agreement, repair, the replayed microbatches,
  the re-reduction, the commit agreement; and ``repair`` -- ``comm.repair()`` alone inside it;
* ``after``: one fault-free step in the repaired world.

Each survivor writes ``rank<r>.json`` into ``--out`` and ends through
:func:`lightning_recover.runtime.lifecycle.end_job`.

With ``--lightning`` the rank is a user's Lightning script instead: the same MLP in a
``LightningModule`` trained by ``Trainer(strategy=ReCoVerHSDPStrategy(...))`` for ``--steps``
+ 2 optimizer steps, and ``steady`` holds what each step cost from one
``on_train_batch_start`` to the next (everything the strategy, its callbacks, the ledger,
the recruiter and Lightning did over MPI in between); no fault is injected. ``--sdc`` adds the
silent-data-corruption check after every step (``recover.sdc.every_n_steps=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one rank of benchmarks/control_plane.py (launched by it)")
    p.add_argument("--out", type=Path, required=True, help="folder for rank<r>.json")
    p.add_argument("--steps", type=int, default=3, help="fault-free steps counted one by one")
    p.add_argument("--victim", type=int, default=-1, help="rank killed in the faulty step (-1: the last rank; never 0)")
    p.add_argument("--kill-at-bucket", type=int, default=1, help="the victim dies before this bucket of the step's reduction")
    p.add_argument("--bucket-bytes", type=int, default=1024, help="FaultTolerantComm bucket size (the MLP has ~2.4 kB of gradients)")
    p.add_argument("--G", type=int, default=2, help="microbatches per replica per step")
    p.add_argument("--lightning", action="store_true", help="count a Lightning Trainer's steps under the strategy (no fault)")
    p.add_argument("--sdc", action="store_true", help="with --lightning: the silent-data-corruption check after every step")
    return p.parse_args(argv)


def lightning_main(args: argparse.Namespace) -> None:
    """The rank as a user's Lightning script; see the module docstring."""
    from lightning_recover.runtime import lifecycle

    lifecycle.prepare_mpi()
    from benchmarks import mpi_counter

    counter = mpi_counter.install()  # before the strategy builds its communicator
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_recover.strategies import ReCoVerHSDPStrategy

    torch.set_num_threads(1)
    marks: list[dict[str, list[int]]] = []

    class Mlp(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Marks(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            marks.append(counter.snapshot())

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 2))
    strategy = ReCoVerHSDPStrategy(shards=1, grad_accum=args.G, bucket_mb=args.bucket_bytes / 2**20,
                                   **({"sdc_every_n_steps": 1} if args.sdc else {}))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps + 2, logger=False, callbacks=[Marks()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(Mlp(), DataLoader(data, batch_size=4))
    end = counter.snapshot()
    steps = [mpi_counter.since(a, b) for a, b in zip(marks, [*marks[1:], end])]
    comm = strategy.comm
    assert comm is not None
    row = {"rank": comm.rank, "world_size": comm.layout.world_size, "lightning": True, "steps_seen": len(marks),
           "first": steps[0] if steps else {}, "steady": steps[1:-1], "last": steps[-1] if steps else {}}
    (args.out / f"rank{comm.rank}.json").write_text(json.dumps(row))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.lightning:
        lightning_main(args)
        return
    from lightning_recover.runtime import lifecycle

    lifecycle.prepare_mpi()
    from mpi4py import MPI  # MPI_Init

    from benchmarks import mpi_counter

    counter = mpi_counter.install()
    from lightning_recover.comm import mpi_wait
    from lightning_recover.comm.communicator import FaultTolerantComm

    # Line up politely: 64 ranks polling in the constructor's blocking collectives starve the ones still importing.
    mpi_wait.wait(MPI.COMM_WORLD.Ibarrier())
    before = counter.snapshot()
    comm = FaultTolerantComm(bucket_bytes=args.bucket_bytes)
    startup = counter.since(before)
    lifecycle.start_rank(comm.rank, MPI.COMM_WORLD.Get_size())

    import torch

    from lightning_recover.callbacks import BoundaryScheduler, EpochCheck, ReductionBuffers
    from lightning_recover.recovery.engine import Probes, StepEngine
    from lightning_recover.recovery.hooks import HookCalls
    from lightning_recover.workload.factory import make_policy

    torch.set_num_threads(1)
    n = comm.layout.world_size
    victim = args.victim if args.victim >= 0 else n - 1
    if not 0 < victim < n:
        raise SystemExit(f"--victim must be a rank in 1..{n - 1} (never the leader), got {victim}")

    torch.manual_seed(0)  # every replica starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=0.01)

    class Runner:
        """The strategy's part: one microbatch's forward and backward into the accumulator."""

        step = 0

        def run_microbatch(self, offset: int) -> None:
            gen = torch.Generator().manual_seed(self.step * 10_007 + offset)
            x = torch.randn(4, 16, generator=gen)
            loss = model(x).pow(2).mean()
            loss.backward()
            engine.record(offset, float(loss.detach()))

        def local_grads(self) -> list[torch.Tensor]:
            return [p.grad for p in params]  # type: ignore[misc]

    fault_step = 1 + args.steps

    class KillProbes(Probes):
        def fault_point(self, phase: str, *, step: int, microbatch: int | None = None, bucket: int | None = None) -> None:
            if comm.rank == victim and step == fault_step and phase == "reduce" and bucket == args.kill_at_bucket:
                time.sleep(0.3)  # the survivors are waiting in this bucket by then
                os.kill(os.getpid(), signal.SIGKILL)

    runner = Runner()
    callbacks: list[object] = [ReductionBuffers(), EpochCheck(), BoundaryScheduler()]
    engine = StepEngine(comm, make_policy("static", n, args.G, T=n), hooks=HookCalls(lambda: callbacks), probes=KillProbes())

    repairs: list[dict[str, list[int]]] = []
    real_repair = comm.repair

    def counted_repair(*a: Any, **k: Any) -> Any:
        mark = counter.snapshot()
        try:
            return real_repair(*a, **k)
        finally:
            repairs.append(counter.since(mark))

    comm.repair = counted_repair  # type: ignore[method-assign]

    def step(t: int) -> tuple[dict[str, list[int]], dict[str, Any]]:
        mark = counter.snapshot()
        runner.step = t
        for p in params:
            p.grad.zero_()  # type: ignore[union-attr]
        state = engine.begin(t)
        engine.run(runner, state.mine.ids)
        engine.reduce_until_committed(runner)
        opt.step()
        record = engine.finish()
        return counter.since(mark), record

    step(0)  # not counted: a first step may set up what later ones reuse
    steady = [step(t)[0] for t in range(1, 1 + args.steps)]
    faulty, record = step(fault_step)
    after, _ = step(fault_step + 1)
    row = {
        "rank": comm.rank,
        "world_size": n,
        "victim": victim,
        "members_after": len(comm.members),
        "world_epoch": comm.world_epoch,
        "polite_wait": mpi_wait.polite(),
        "buckets": len(engine.comm.plan([p.grad for p in params][::-1]).buckets),  # type: ignore[misc]
        "fault_record": {"faults": record.get("faults"), "committed": record.get("committed")},
        "startup": startup,
        "steady": steady,
        "faulty": faulty,
        "repairs": repairs,
        "after": after,
        "param_sum": float(sum(p.detach().double().sum() for p in params)),
    }
    (args.out / f"rank{comm.rank}.json").write_text(json.dumps(row))
    lifecycle.end_job(comm, exit_code=0)


if __name__ == "__main__":
    main()
