"""SUM all-reduce bandwidth: FaultTolerantComm (ULFM MPI) vs torch.distributed gloo.

Run it as ``python -m benchmarks.allreduce``. The script launches itself through
``lightning-recover launch -n N`` (i.e. ``mpiexec --with-ft ulfm``) for N = 2 and 4, each
job under a hard timeout. Inside a job every rank creates both a ``FaultTolerantComm``
(reducing over the whole world, ``across="world"``) and a gloo process group on the same
ranks (TCPStore address and port broadcast over MPI), then times the two *alternately*
on identical fp32 buffers: warm-up first, then ``--iters`` timed rounds per size, each
round one ULFM reduce and one gloo reduce, in alternating order.

Bandwidth is *algorithm bandwidth*: buffer bytes / time, where the time of one iteration
is the slowest rank's (ranks are lined up by an MPI barrier before every timed call).
We report the median over iterations. Results go to ``benchmarks/results/allreduce.json``;
the last line printed is the headline ratio at 64 MB.

Options: ``--sizes-mb 4 64``, ``--ranks 2 4``, ``--iters``, ``--warmup``,
``--bucket-mb`` (bucket size of the FaultTolerantComm; default: the library default,
4 MiB), ``--sweep-buckets-mb`` (bucket sizes also timed at the largest buffer size) and
``--timeout`` (seconds per mpiexec job).

``--data-planes`` also times the cross-replica reduction over each data plane
(:mod:`lightning_recover.comm.data_plane`): ``FaultTolerantComm(data_plane="mpi")`` and
``FaultTolerantComm(data_plane="gloo")`` reducing ``across="replicas"`` (one shard, so the
whole world), out of place, at every buffer size with the bucket size above and at the
largest size with every swept bucket size. The last line is then the headline ratio
gloo plane / MPI plane bandwidth at the largest size.

Run it on a quiet machine. MPI's shared-memory path needs its ranks on a core at the same
time; when other processes compete for the cores its large-message bandwidth collapses
far more than gloo's (TCP loopback, kernel-buffered). The script measures the CPU load
around the run, stores it in the JSON and warns when it was busy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "allreduce.json"
MB = 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to run (one mpiexec job each)")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 64], help="fp32 buffer sizes in MiB")
    p.add_argument("--iters", type=int, default=0, help="timed iterations per size (0: 40 for <=16 MiB, else 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per size and backend")
    p.add_argument("--bucket-mb", type=float, default=None, help="FaultTolerantComm bucket size in MiB (default: library default)")
    p.add_argument("--sweep-buckets-mb", type=float, nargs="*", default=[1, 4, 16, 25, 64],
                   help="extra bucket sizes timed (out-of-place) at the largest buffer size; none to skip")
    p.add_argument("--data-planes", action="store_true",
                   help="also time the gloo data plane vs the MPI one (FaultTolerantComm data_plane=...); last line = their ratio")
    p.add_argument("--timeout", type=float, default=150, help="hard timeout per mpiexec job in seconds")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON results file")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # set when run under mpiexec
    return p.parse_args(argv)


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of all cores busy over ``seconds`` (Linux /proc/stat), or None if unknown."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1 - (i1 - i0) / max(1, t1 - t0)


def iters_for(size_mb: float, iters: int) -> int:
    return iters if iters > 0 else (40 if size_mb <= 16 else 20)


# ---------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from lightning_recover.runtime import lifecycle

    lifecycle.prepare_mpi()
    from mpi4py import MPI

    from lightning_recover.comm.communicator import DEFAULT_BUCKET_BYTES, FaultTolerantComm

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    bucket_bytes = int(args.bucket_mb * MB) if args.bucket_mb else DEFAULT_BUCKET_BYTES
    comm = FaultTolerantComm(bucket_bytes=bucket_bytes)
    # The data planes: one communicator per plane, each with its own buckets and plane.
    planes = {k: FaultTolerantComm(bucket_bytes=bucket_bytes, data_plane=k) for k in ("mpi", "gloo")} if args.data_planes else {}

    # gloo on the same ranks: rank 0 hosts the TCPStore on a free port, MPI tells the others.
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        addr = ("127.0.0.1", port)
    else:
        addr = None
    host, port = world.bcast(addr, root=0)
    store = dist.TCPStore(host, port, size, is_master=(rank == 0), wait_for_workers=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)

    def ulfm(bucket: int):
        def run(x: torch.Tensor, y: torch.Tensor) -> None:
            comm.bucket_bytes = bucket  # plan() splits by the current setting
            comm.allreduce([x], [y], across="world")  # x stays the local value (the rollback copy), zero-copy

        return run

    def gloo(x: torch.Tensor, y: torch.Tensor) -> None:
        dist.all_reduce(y)

    def plane(pc: FaultTolerantComm, bucket: int):
        def run(x: torch.Tensor, y: torch.Tensor) -> None:
            pc.bucket_bytes = bucket
            pc.allreduce([x], [y])  # across="replicas": this world epoch's data plane

        return run

    results = []
    for size_mb in args.sizes_mb:
        backends = {"ulfm": ulfm(bucket_bytes), "gloo": gloo}
        if size_mb == max(args.sizes_mb):
            for b in args.sweep_buckets_mb or []:
                backends[f"ulfm@{b:g}MB"] = ulfm(int(b * MB))
        plane_buckets = [bucket_bytes] + [int(b * MB) for b in (args.sweep_buckets_mb or []) if size_mb == max(args.sizes_mb)]
        for kind, pc in planes.items():
            for b in dict.fromkeys(plane_buckets):
                backends[f"plane_{kind}@{b / MB:g}MB"] = plane(pc, b)
        n = int(size_mb * MB) // 4
        x = torch.full((n,), float(rank + 1), dtype=torch.float32)
        y = torch.empty_like(x)
        expect = size * (size + 1) / 2

        def timed(fn) -> float:
            y.copy_(x)  # gloo reduces y in place; ours overwrites it
            world.Barrier()
            t0 = time.perf_counter()
            fn(x, y)
            dt = time.perf_counter() - t0
            return world.allreduce(dt, op=MPI.MAX)

        for name, fn in backends.items():  # warm-up, and a correctness check of every path
            for _ in range(args.warmup):
                timed(fn)
            if not (y[0].item() == expect and y[-1].item() == expect and bool((y == expect).all())):
                raise SystemExit(f"rank {rank}: {name} gave a wrong sum at {size_mb} MiB")
        times: dict[str, list[float]] = {k: [] for k in backends}
        order = list(backends)
        for it in range(iters_for(size_mb, args.iters)):
            for name in order if it % 2 == 0 else order[::-1]:  # alternate, so drift hits all alike
                times[name].append(timed(backends[name]))
        nbytes = n * 4
        for name, ts in times.items():
            med = statistics.median(ts)
            results.append(
                {
                    "backend": name,
                    "ranks": size,
                    "size_mb": size_mb,
                    "bytes": nbytes,
                    "iters": len(ts),
                    "median_s": med,
                    "min_s": min(ts),
                    "max_s": max(ts),
                    "algbw_GBps": nbytes / med / 1e9,
                }
            )
        del x, y
    comm.bucket_bytes = bucket_bytes
    if rank == 0:
        buckets = len(comm.plan([torch.empty(int(max(args.sizes_mb) * MB) // 4)]).buckets)
        meta = {"bucket_bytes": bucket_bytes, "buckets_at_max_size": buckets, "mpi": MPI.Get_library_version().strip().splitlines()[0]}
        args.worker.write_text(json.dumps({"results": results, "meta": meta}))
    dist.destroy_process_group()
    for pc in planes.values():
        lifecycle.end_job(pc)
    lifecycle.end_job(comm)


# ---------------------------------------------------------------------------------- driver
def run_job(nprocs: int, args: argparse.Namespace, outfile: Path) -> str:
    """Run one benchmark job; returns the mpiexec command line the launcher printed."""
    cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", str(nprocs), "--",
           sys.executable, str(Path(__file__).resolve()), "--worker", str(outfile),
           "--sizes-mb", *map(str, args.sizes_mb), "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if args.bucket_mb:
        cmd += ["--bucket-mb", str(args.bucket_mb)]
    if args.data_planes:
        cmd += ["--data-planes"]
    cmd += ["--sweep-buckets-mb", *map(str, args.sweep_buckets_mb or [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise SystemExit(f"benchmark job with {nprocs} ranks timed out after {args.timeout:g}s\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # reap any rank that outlived mpiexec
        except ProcessLookupError:
            pass
    if proc.returncode != 0 or not outfile.exists():
        raise SystemExit(f"benchmark job with {nprocs} ranks failed (rc={proc.returncode})\n{out[-4000:]}")
    return next((line[len("[lightning-recover] "):] for line in out.splitlines() if line.startswith("[lightning-recover] ")), "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    t_start = time.perf_counter()
    busy_before = cpu_busy()
    rows: list[dict] = []
    meta: dict = {}
    commands: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="lr-bench-") as tmp:
        for n in args.ranks:
            outfile = Path(tmp) / f"ranks{n}.json"
            t0 = time.perf_counter()
            launched = run_job(n, args, outfile)
            data = json.loads(outfile.read_text())
            rows += data["results"]
            meta = data["meta"]
            commands[n] = launched
            print(f"[bench] {n} ranks done in {time.perf_counter() - t0:.1f}s", flush=True)

    def bw(backend: str, ranks: int, size: float) -> float:
        return next(r["algbw_GBps"] for r in rows if r["backend"] == backend and r["ranks"] == ranks and r["size_mb"] == size)

    ratios = []
    for n in args.ranks:
        for s in args.sizes_mb:
            g = bw("gloo", n, s)
            ratios.append({"ranks": n, "size_mb": s, "ulfm_over_gloo": bw("ulfm", n, s) / g})

    print(f"bucket_bytes={meta['bucket_bytes']} ({meta['bucket_bytes'] / MB:g} MiB); cores={os.cpu_count()}; {meta['mpi']}")
    print("algorithm bandwidth (buffer bytes / median time of the slowest rank), GB/s")
    header = f"{'ranks':>5} {'size':>7} {'ulfm':>9} {'gloo':>9} {'ulfm/gloo':>10}"
    print(header)
    print("-" * len(header))
    for r in ratios:
        n, s = r["ranks"], r["size_mb"]
        print(f"{n:>5} {s:>5g}MB {bw('ulfm', n, s):>9.3f} {bw('gloo', n, s):>9.3f} {r['ulfm_over_gloo']:>9.2f}x")

    big = max(args.sizes_mb)
    sweep = [f"ulfm@{b:g}MB" for b in args.sweep_buckets_mb or []]
    if sweep:
        print(f"\nbucket-size sweep at {big:g} MB, out-of-place ulfm, GB/s (ratio to gloo in parentheses)")
        print(f"{'ranks':>5} " + " ".join(f"{name[5:]:>15}" for name in sweep))
        for n in args.ranks:
            g = bw("gloo", n, big)
            print(f"{n:>5} " + " ".join(f"{bw(name, n, big):>7.3f} ({bw(name, n, big) / g:4.2f}x)" for name in sweep))
    cores = os.cpu_count() or 1
    busy_after = cpu_busy()
    if any(n > cores for n in args.ranks):
        print(f"note: runs with more ranks than the {cores} cores are oversubscribed; expect noise")
    busiest = max((b for b in (busy_before, busy_after) if b is not None), default=0.0)
    if busiest > 0.25:
        print(f"WARNING: other processes kept {busiest:.0%} of the CPUs busy around the benchmark; "
              "these numbers are noisy -- rerun on a quiet machine")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "SUM all-reduce of one fp32 buffer; algbw = bytes / median(max over ranks of per-call time)",
        "ulfm": "FaultTolerantComm.allreduce(across='world'), out of place (the inputs are the rollback copy)",
        "ulfm@<B>MB": "out-of-place FaultTolerantComm.allreduce with bucket_bytes = B MiB (sweep, largest size only)",
        "gloo": "torch.distributed.all_reduce on a gloo group over the same ranks, in place",
        "host": {"cores": os.cpu_count(), "cpu_busy_before": busy_before, "cpu_busy_after": busy_after, "machine": platform.machine(), "python": platform.python_version()},
        "meta": meta,
        "mpiexec_commands": commands,
        "wall_s": time.perf_counter() - t_start,
        "results": rows,
        "ratios": ratios,
    }, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    parts = [f"{r['ulfm_over_gloo']:.2f}x ({r['ranks']} ranks)" for r in ratios if r["size_mb"] == big]
    line = f"ratio ulfm/gloo bandwidth at {big:g} MB: " + ", ".join(parts) + f" [bucket {meta['bucket_bytes'] / MB:g} MiB"
    if sweep:  # the swept bucket size with the best worst-case ratio over the rank counts
        best = max(sweep, key=lambda name: min(bw(name, n, big) / bw("gloo", n, big) for n in args.ranks))
        line += f"; best swept bucket {best[5:]}: " + ", ".join(f"{bw(best, n, big) / bw('gloo', n, big):.2f}x" for n in args.ranks)
    print(line + "]")
    if args.data_planes:
        print(plane_report(rows, args, meta["bucket_bytes"]))
    return 0


def plane_report(rows: list[dict], args: argparse.Namespace, bucket_bytes: int) -> str:
    """The data-plane table (printed); returns its headline, the last line."""

    def bw(name: str, ranks: int, size: float) -> float | None:
        return next((r["algbw_GBps"] for r in rows if r["backend"] == name and r["ranks"] == ranks and r["size_mb"] == size), None)

    print("\ndata planes: cross-replica reduce (FaultTolerantComm.allreduce, out of place), GB/s")
    header = f"{'ranks':>5} {'size':>7} {'bucket':>8} {'mpi':>9} {'gloo':>9} {'gloo/mpi':>9}"
    print(header)
    print("-" * len(header))
    buckets = [bucket_bytes / MB, *(args.sweep_buckets_mb or [])]
    for n in args.ranks:
        for s in args.sizes_mb:
            for b in dict.fromkeys(buckets):
                m, g = bw(f"plane_mpi@{b:g}MB", n, s), bw(f"plane_gloo@{b:g}MB", n, s)
                if m is not None and g is not None:
                    print(f"{n:>5} {s:>5g}MB {b:>6g}MB {m:>9.3f} {g:>9.3f} {g / m:>8.2f}x")
    big, default = max(args.sizes_mb), bucket_bytes / MB
    parts = [f"{bw(f'plane_gloo@{default:g}MB', n, big) / bw(f'plane_mpi@{default:g}MB', n, big):.2f}x ({n} ranks)" for n in args.ranks]  # type: ignore[operator]
    return f"ratio gloo/mpi data plane bandwidth at {big:g} MB, bucket {default:g} MiB: " + ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
