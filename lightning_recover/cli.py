"""The ``lightning-recover`` command: launch fault-tolerant jobs, check their step ledgers, report their recovery metrics.

The demo and the chaos campaign are tools of a source checkout (``examples/demo.py``,
``benchmarks/chaos.py``), not commands of the installed package.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable


def _launch(argv: list[str]) -> int:
    from lightning_recover.launcher import launch

    parser = argparse.ArgumentParser(
        prog="lightning-recover launch",
        description="Run CMD on N ranks under 'mpiexec --with-ft ulfm' (prints the command it runs).",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of MPI ranks (replicas x shards)")
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
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.hang_timeout is not None:
        if not args.hang_timeout >= 0 or args.hang_timeout == float("inf"):
            print(f"lightning-recover launch: --hang-timeout must be >= 0 seconds, got {args.hang_timeout:g}", file=sys.stderr)
            return 2
        os.environ["LIGHTNING_RECOVER_HANG_TIMEOUT"] = f"{args.hang_timeout:g}"
    detector = args.hang_timeout if args.mpi_detector and args.hang_timeout else None
    try:
        return launch(args.nprocs, command, hang_timeout=detector, extra=args.mpi_arg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"lightning-recover launch: {exc}", file=sys.stderr)
        return 2


def _check_ledger(argv: list[str]) -> int:
    from lightning_recover.ledger import main as ledger_main

    return ledger_main(argv)


def _report(argv: list[str]) -> int:
    from lightning_recover.report import main as report_main

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
    "chaos": "python benchmarks/chaos.py",
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
