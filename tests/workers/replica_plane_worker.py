"""MPI worker for the replica plane: FSDP2's in-replica collectives on MPI, one scenario per run.

Replicas are consecutive blocks of ``LR_SHARDS`` world ranks (as in the strategy). Each
rank writes ``rank{R}.json``; a rank that dies writes nothing.

* ``values``: all-gather (fp32, bf16, int64) and reduce-scatter (SUM and AVG in fp32, SUM
  in bf16) against exact or fp64 references; MAX is refused with ValueError.
* ``kill``: the last rank of the last replica SIGKILLs itself before an all-gather; its
  mates must get ReplicaPlaneError (not hang), the other replicas go on gathering. (A
  SIGSTOPped mate is first killed by the strategy's heartbeat watchdog: that case runs in
  tests/launched/test_strategy_mpi.py.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

from lightning_recover.comm.replica_plane import MPIAllGather, MPIReduceScatter, ReplicaPlaneError
from lightning_recover.runtime import lifecycle

torch.set_num_threads(1)


def values(mates, shards: int, rank: int) -> dict:
    from torch.distributed import ReduceOp

    gather, scatter = MPIAllGather(mates), MPIReduceScatter(mates)
    me = mates.Get_rank()
    out: dict = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("int64", torch.int64)):
        src = (torch.arange(5, dtype=torch.float64) + 10 * me).to(dtype)
        dst = gather.allocate((5 * shards,), dtype=dtype, device=torch.device("cpu"))
        gather(dst, src, None)
        want = torch.cat([(torch.arange(5, dtype=torch.float64) + 10 * s).to(dtype) for s in range(shards)])
        out[f"gather_{name}"] = bool(torch.equal(dst, want))
    n = 7
    inputs = [torch.arange(n * shards, dtype=torch.float64).mul(0.37).add(s + 1).mul(s + 1.5) for s in range(shards)]
    exact = torch.stack(inputs).sum(0)[me * n:(me + 1) * n]
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        dst = torch.empty(n, dtype=torch.float32)
        scatter(dst, inputs[me].float(), None, op)
        want = exact / (shards if op == ReduceOp.AVG else 1)
        out[f"scatter_fp32_{op.name}_err"] = float((dst.double() - want).abs().max())
    dst = torch.empty(n, dtype=torch.bfloat16)
    scatter(dst, inputs[me].bfloat16(), None, ReduceOp.SUM)
    widened = torch.stack([x.bfloat16().double() for x in inputs]).sum(0)[me * n:(me + 1) * n]
    out["scatter_bf16_equals_fp32_sum_rounded"] = bool(torch.equal(dst, widened.float().bfloat16()))
    try:
        scatter(torch.empty(n), inputs[me].float(), None, ReduceOp.MAX)
        out["max_refused"] = ""
    except ValueError as exc:
        out["max_refused"] = str(exc)
    out["calls"] = gather.calls + scatter.calls
    return out


def kill(mates, shards: int, rank: int, world: int) -> dict:
    victim = world - 1
    gather = MPIAllGather(mates)
    src = torch.full((1000,), float(rank))
    dst = torch.empty(1000 * shards)
    gather(dst, src, None)  # every replica works before the fault
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.perf_counter()
    result: dict = {"gathers_after": 0}
    try:
        for _ in range(200):
            gather(dst, src, None)
            result["gathers_after"] += 1
            time.sleep(0.01)
        result["error"] = None
    except ReplicaPlaneError as exc:
        result["error"] = str(exc)
    result["seconds"] = time.perf_counter() - started
    return result


def main() -> None:
    scenario = sys.argv[1]
    lifecycle.prepare_mpi()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    shards = int(os.environ.get("LR_SHARDS", "2"))
    mates = world.Split(rank // shards, rank % shards)
    mates.Set_errhandler(MPI.ERRORS_RETURN)
    result = values(mates, shards, rank) if scenario == "values" else kill(mates, shards, rank, size)
    result["rank"] = rank
    with open(os.path.join(os.environ["LR_TEST_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # no MPI_Finalize with a dead peer (see lightning_recover.cli.mpiexec.launch_env)


if __name__ == "__main__":
    main()
