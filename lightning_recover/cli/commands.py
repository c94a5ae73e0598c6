"""The ``lightning-recover`` command: launch fault-tolerant jobs, check their step ledgers, report their recovery metrics.

The demo and the chaos campaign are tools of a source checkout (``examples/demo.py``,
``benchmarks/chaos.py``), not commands of the installed package.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_recover.cli.supervision import Host


SUPERVISE_HELP = """\
supervised mode (--supervise): when the job ends in a way no rank can repair in place -- Open
MPI's runtime lost a host's daemon and aborted the whole job (mpiexec still says 0), every
replica died, a rank was lost before its communicator came up, the ledger stopped growing for
--stall-timeout seconds, or the job stopped below min_replicas -- the same command is relaunched from the newest checkpoint in --checkpoint-dir,
with RESUME_ARG (default '++ckpt_path=last') appended (replacing the command's own value of that
key), on the hosts that remain: --hosts/--hostfile (or the Slurm allocation's nodes) minus every
host PRRTE named as lost or that does not answer a probe through mpiexec's ssh agent. A
relaunch takes as many whole replicas (--replica-size ranks each) as the slots hold, at most
-n; B and the sample order come from the checkpoint, so the ledger continues the fault-free
run. At most --max-relaunches relaunches, waiting --relaunch-backoff seconds (doubling) before
each. Ranks see LIGHTNING_RECOVER_ATTEMPT (0 = first launch). A program error (an uncaught
exception, a configuration error) is never relaunched. With --ledger the time each relaunch
lost is printed (detection, relaunch, restore, replay since the checkpoint).
"""


def _launch(argv: list[str]) -> int:
    from lightning_recover.cli.launcher import launch, supervise
    from lightning_recover.cli.supervision import SupervisionPolicy
    from lightning_recover.runtime.slurm import allocation_tasks, daemon_step_args, tasks_outnumber_cpus

    args = _launch_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.hang_timeout is not None:
        if not args.hang_timeout >= 0 or args.hang_timeout == float("inf"):
            print(f"lightning-recover launch: --hang-timeout must be >= 0 seconds, got {args.hang_timeout:g}", file=sys.stderr)
            return 2
        os.environ["LIGHTNING_RECOVER_HANG_TIMEOUT"] = f"{args.hang_timeout:g}"
    detector = args.hang_timeout if args.mpi_detector and args.hang_timeout else None
    try:
        tasks = allocation_tasks()
        nprocs = args.nprocs if args.nprocs is not None else tasks
        if nprocs is None:
            raise ValueError("give the number of ranks: -n N (only inside a Slurm allocation does it default to SLURM_NTASKS)")
        # Inside an allocation whose nodes hold more tasks than CPUs (sbatch -O), or asked for more ranks
        # than tasks, Open MPI's binding to cores fails: run unbound, unless the user chose a binding.
        unbound = (
            tasks is not None and (tasks_outnumber_cpus() or nprocs > tasks)
            and not any(a.startswith("--bind-to") for a in args.mpi_arg)
        )
        hosts = _hosts_of(args)
        mpi_args = [*args.mpi_arg, *daemon_step_args(args.mpi_arg)]  # --overlap for Open MPI's srun inside an allocation
        if not args.supervise:
            return launch(
                nprocs, command, hang_timeout=detector, extra=mpi_args, hosts=hosts, unbound=unbound,
                status_root=args.status_dir,
            )
        if args.checkpoint_dir is None:
            raise ValueError("--supervise needs --checkpoint-dir DIR (the job's recover.checkpoint.dir), where a relaunch resumes from")
        policy = SupervisionPolicy(
            max_relaunches=args.max_relaunches, replica_size=args.replica_size, min_replicas=args.min_replicas,
            oversubscribe=args.oversubscribe, backoff_s=args.relaunch_backoff, max_backoff_s=max(60.0, args.relaunch_backoff),
        )
        return supervise(
            nprocs, command, policy=policy, checkpoint_dir=args.checkpoint_dir, hosts=hosts, ledger=args.ledger,
            resume_arg=args.resume_arg, stall_timeout_s=args.stall_timeout, hang_timeout=detector, extra=mpi_args,
            status_root=args.status_dir, unbound=unbound,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"lightning-recover launch: {exc}", file=sys.stderr)
        return 2


def _launch_parser() -> argparse.ArgumentParser:
    from lightning_recover.cli.launcher import DEFAULT_RESUME_ARG

    parser = argparse.ArgumentParser(
        prog="lightning-recover launch",
        description="Run CMD on N ranks under 'mpiexec --with-ft ulfm' (prints the command it runs).",
        epilog=SUPERVISE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-n", "--nprocs", type=int, default=None,
        help="number of MPI ranks (replicas x shards); inside a Slurm allocation the default is its task count (SLURM_NTASKS)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a rank silent this long is declared dead, killed and its replica removed. Sets "
        "LIGHTNING_RECOVER_HANG_TIMEOUT for the strategy's heartbeat watchdog (default 10 s, 0 = off)",
    )
    parser.add_argument(
        "--mpi-detector",
        action="store_true",
        help="also turn on Open MPI's ULFM failure detector (thread) with --hang-timeout; needed when a "
        "node runs a single rank, but seen to crash at start-up beside torch in Open MPI 5.0.11",
    )
    parser.add_argument("--mpi-arg", action="append", default=[], help="extra argument passed to mpiexec (repeatable); one that starts with a dash as --mpi-arg=--host")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="H1:S1,H2:S2", help="hosts and their slots (mpiexec --host); default: this machine")
    where.add_argument("--hostfile", metavar="FILE", help="an Open MPI hostfile ('node slots=N' per line)")
    sup = parser.add_argument_group("supervised relaunch (see below)")
    sup.add_argument("--supervise", action="store_true", help="relaunch from the newest checkpoint when the job aborts, dies or stalls")
    sup.add_argument("--checkpoint-dir", metavar="DIR", help="where the job writes its checkpoints (recover.checkpoint.dir); required with --supervise")
    sup.add_argument("--ledger", metavar="FILE", help="the job's step ledger (recover.ledger_path): progress for --stall-timeout, and the cost report")
    sup.add_argument("--max-relaunches", type=int, default=3, metavar="K", help="relaunches at most (default 3)")
    sup.add_argument("--replica-size", type=int, default=1, metavar="S", help="ranks per replica (recover.shards; default 1)")
    sup.add_argument("--min-replicas", type=int, default=1, metavar="M", help="give up when the remaining slots hold fewer replicas (default 1)")
    sup.add_argument("--oversubscribe", action="store_true", help="a relaunch keeps -n ranks even when the remaining hosts have fewer slots")
    sup.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                     help="end and relaunch an attempt whose --ledger gains no step this long (counted from its start; "
                     "must exceed start-up + restore + the slowest step and checkpoint write). Default: off")
    sup.add_argument("--relaunch-backoff", type=float, default=1.0, metavar="SECONDS", help="wait before the first relaunch, doubling (max 60 s)")
    sup.add_argument("--resume-arg", default=DEFAULT_RESUME_ARG, metavar="ARG",
                     help=f"appended to CMD on a relaunch when a checkpoint exists (default {DEFAULT_RESUME_ARG!r})")
    parser.add_argument("--status-dir", metavar="DIR",
                        help="where the ranks leave their status markers, kept after the job (default: a temporary "
                        "directory here, removed); on several hosts give a directory every host shares")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    return parser


def _hosts_of(args: argparse.Namespace) -> tuple[Host, ...] | None:
    """The hosts of --hosts or --hostfile, else the Slurm allocation's nodes; None: this machine."""
    from lightning_recover.cli.hosts import slurm_allocation
    from lightning_recover.cli.supervision import parse_host_list, parse_hostfile

    if args.hosts is not None:
        return parse_host_list(args.hosts)
    if args.hostfile is not None:
        try:
            with open(args.hostfile, encoding="utf-8") as f:
                return parse_hostfile(f.read(), args.hostfile)
        except OSError as exc:
            raise ValueError(f"--hostfile {args.hostfile!r} cannot be read ({exc.strerror or exc})") from None
    return slurm_allocation()  # None outside Slurm: this machine


def _check_ledger(argv: list[str]) -> int:
    from lightning_recover.audit.ledger_check import main as ledger_main

    return ledger_main(argv)


def _report(argv: list[str]) -> int:
    from lightning_recover.audit.report import main as report_main

    return report_main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "launch": (_launch, "run a command on N ranks under mpiexec --with-ft ulfm"),
    "check-ledger": (_check_ledger, "verify a step ledger (exactly-once ids, constant B, loss vs a reference)"),
    "report": (_report, "recovery metrics of a run from its ledger (MTTR, MTBF, replay ratio, joins, throughput)"),
}

#: Former commands that need the example model, so they live in the source checkout now;
#: a user following older instructions is told where instead of being shown the usage.
MOVED: dict[str, str] = {
    "demo": "python examples/demo.py",
    "chaos": "python -m benchmarks.chaos",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in MOVED:
        print(
            f"lightning-recover: {argv[0]!r} is no longer a command; from a source checkout run: {MOVED[argv[0]]}",
            file=sys.stderr,
        )
        return 2
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in COMMANDS:
        lines = ["usage: lightning-recover COMMAND [ARGS]", "", "commands:"]
        lines += [f"  {name:<14} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("\n".join(lines), file=sys.stderr if argv and argv[0] not in {"-h", "--help"} else sys.stdout)
        if argv and argv[0] not in {"-h", "--help"}:
            print(f"lightning-recover: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    func, _ = COMMANDS[argv[0]]
    return func(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
