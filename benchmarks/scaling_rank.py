"""One rank of a ``benchmarks/scaling.py`` job: layer 1 alone, real SIGKILLs, phase timestamps.

Contract: launched by ``scaling.py`` through ``lightning-recover launch -n N`` (i.e.
``mpiexec --with-ft ulfm``, ``--oversubscribe`` past the cores). Every rank builds a
:class:`~lightning_recover.comm.communicator.FaultTolerantComm` (one shard, so every rank is a
replica) with a tiny buffer (``--numel`` fp32 in ``--bucket-bytes`` buckets), and then, for
each victim named by ``--victims`` (original world ranks, in order), runs one *faulty step*:

1. every live rank lines up in a world reduction (the step header's kind, polite wait);
2. every live rank starts the step's bucketed reduction; the victim completes buckets
   ``0 .. --kill-at-bucket - 1`` with the others, then (``on_bucket``, before its next bucket)
   sleeps ``--pre-kill`` seconds (the survivors are by then waiting in that bucket), writes
   ``kill<k>.json`` with its ``time.monotonic()`` and pid, and SIGKILLs itself (``os.kill``:
   a real process death, no MPI call). The buckets done before it are stale after the repair;
3. each survivor stamps ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process
   of this machine) when the failure surfaces as ``PeerFailure`` (*detect*), when
   ``agree(False)`` returns (*agree*), when ``repair()`` reaches its ``repair:shrunk`` point,
   i.e. ``MPI_Comm_shrink`` returned (*shrunk*, through ``comm.fault_hook``), when
   ``repair()`` returns (*repaired*: splits, agreement on the new world, quorum, new data
   plane), when the stale and the pending buckets were reduced in the new world (*rereduced*), and
   when the step's commit agreement returned True (*committed*);
4. the re-reduced sums are checked exactly against the survivors' values.

Each survivor writes ``rank<r>.json`` (its stamps, start-up times, peak RSS, whether and
by whom torch was loaded) into ``--out`` and ends through :func:`lightning_recover.runtime.lifecycle.end_job`.
The driver turns the stamps into per-phase times (see ``scaling.py``).

Torch: layer 1 alone loads none. Importing ``lightning_recover.comm.communicator`` and building
the communicator on the MPI plane import no torch (the rank records it: ``torch_loaded_by_comm``);
the rank itself imports torch afterwards, for the tensors it reduces (``FaultTolerantComm.allreduce``
takes torch tensors), and records how long that took (``import_torch_s``); ``scaling.py`` reports both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

T_PROCESS = time.monotonic()  # before any heavy import: start-up is measured from here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one rank of benchmarks/scaling.py (launched by it)")
    p.add_argument("--out", type=Path, required=True, help="folder for rank<r>.json and kill<k>.json")
    p.add_argument("--victims", default="", help="comma-separated original world ranks, killed one per faulty step")
    p.add_argument("--numel", type=int, default=256, help="fp32 elements of the step's buffer")
    p.add_argument("--bucket-bytes", type=int, default=256, help="FaultTolerantComm bucket size")
    p.add_argument("--kill-at-bucket", type=int, default=2, help="the victim dies before this bucket of the step")
    p.add_argument("--pre-kill", type=float, default=0.5, help="seconds the victim waits before killing itself")
    p.add_argument("--t-launch", type=float, default=None, help="driver's time.monotonic() at launch")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    victims = [int(v) for v in args.victims.split(",") if v]
    from lightning_recover.comm import mpi_wait
    from lightning_recover.runtime import lifecycle

    lifecycle.prepare_mpi()
    from mpi4py import MPI  # MPI_Init happens here

    t_mpi = time.monotonic()
    torch_before = "torch" in sys.modules
    # Layer 1 alone: neither this import nor building the communicator below loads torch.
    from lightning_recover.comm.communicator import FaultTolerantComm
    from lightning_recover.comm.interface import PeerFailure

    t_import = time.monotonic()

    # Line up politely first: the constructor's collectives (Dup, allgather, Split) block and poll,
    # and 63 ranks polling on 2 cores starve the ones still starting up (the 64-rank start-up
    # took 136 s that way instead of ~60 s, when the communicator's import still loaded torch).
    mpi_wait.wait(MPI.COMM_WORLD.Ibarrier())
    t_lined_up = time.monotonic()
    comm = FaultTolerantComm(bucket_bytes=args.bucket_bytes)
    lifecycle.start_rank(comm.rank, MPI.COMM_WORLD.Get_size())
    t_comm = time.monotonic()
    torch_by_comm = "torch" in sys.modules and not torch_before
    # Only now, for this rank's own tensors (allreduce takes torch tensors); the step's first
    # world reduction waits politely for the slowest importer.
    import torch

    torch.set_num_threads(1)
    t_torch = time.monotonic()
    rank = comm.rank
    if any(v == 0 or not 0 < v < comm.layout.world_size for v in victims) or len(set(victims)) != len(victims):
        raise SystemExit(f"--victims must be distinct ranks in 1..{comm.layout.world_size - 1}, got {victims}")

    local = torch.full((args.numel,), float(rank + 1), dtype=torch.float32)
    out = torch.empty_like(local)
    one = torch.ones(1, dtype=torch.float32)
    count = torch.empty_like(one)
    faults: list[dict[str, Any]] = []

    for k, victim in enumerate(victims):
        # 1. Line up (polite: the world plane waits with mpi_wait on an oversubscribed host).
        # A survivor whose line-up is cut short by the death (the victim left right after its
        # own part) records the detection there; the step's reduction then runs after repair.
        handle = comm.plan([local])
        stamps: dict[str, float] = {}
        where = "step"

        def on_bucket(i: int, victim: int = victim, k: int = k) -> None:
            if rank == victim and i == min(args.kill_at_bucket, len(handle.buckets) - 1):
                time.sleep(args.pre_kill)
                (args.out / f"kill{k}.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), "t_kill": time.monotonic()}))
                os.kill(os.getpid(), signal.SIGKILL)

        try:
            comm.allreduce([one], [count], across="world")
            stamps["t_step"] = time.monotonic()
            comm.allreduce([local], [out], handle=handle, on_bucket=on_bucket)
            ok = True  # the victim never contributed: not reachable while it is dead
        except PeerFailure as exc:
            ok = False
            where = exc.where
        stamps["detect"] = time.monotonic()
        agreed = comm.agree(ok)
        stamps["agree"] = time.monotonic()
        comm.fault_hook = lambda point: stamps.setdefault("shrunk", time.monotonic()) if point == "repair:shrunk" else None
        result = comm.repair() if not agreed else None
        comm.fault_hook = None
        stamps["repaired"] = time.monotonic()
        stale = handle.stale(comm.world_epoch)  # completed under the old world: rolled back and redone
        pending = len(handle.pending(comm.world_epoch))
        comm.allreduce([local], [out], handle=handle)
        stamps["rereduced"] = time.monotonic()
        committed = comm.agree(True)
        stamps["committed"] = time.monotonic()
        expected = float(sum(r + 1 for r in comm.members))
        faults.append({
            "fault": k,
            "victim": victim,
            "members_after": len(comm.members),
            "ok_before_agree": ok,
            "agreed_false": not agreed,
            "detected_in": where,
            "repair_rounds": None if result is None else result.rounds,
            "lost_ranks": None if result is None else list(result.lost_ranks),
            "buckets": len(handle.buckets),
            "buckets_redone": pending,
            "buckets_stale": len(stale),
            "committed": committed,
            "exact": bool((out == expected).all()),
            "world_epoch": comm.world_epoch,
            "stamps": stamps,
        })

    result_row = {
        "rank": rank,
        "pid": os.getpid(),
        "world_size": comm.layout.world_size,
        "t_process": T_PROCESS,
        "t_launch": args.t_launch,
        "mpi_init_s": t_mpi - T_PROCESS,
        "import_comm_s": t_import - t_mpi,
        "lineup_s": t_lined_up - t_import,
        "comm_init_s": t_comm - t_lined_up,
        "import_torch_s": t_torch - t_comm,
        "t_ready": t_torch,
        "torch_loaded_before_comm": torch_before,
        "torch_loaded_by_comm": torch_by_comm,
        "torch_loaded": "torch" in sys.modules,
        "polite_wait": mpi_wait.polite(),  # the world's choice: reductions sleep instead of spinning
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "faults": faults,
        "t_done": time.monotonic(),
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result_row))
    lifecycle.end_job(comm, exit_code=0)


if __name__ == "__main__":
    main()
