"""lightning-recover: survive replica failures in Lightning HSDP training without restarting.

Layers (see DESIGN.md):
  communicator  fault-aware ULFM collectives, world epochs, replica-consistency gate
  policy        versatile workload (constant B, spares, boundary steps)
  planner       exactly-once microbatch ids -> samples, per-microbatch RNG
  ledger        one JSON line per committed step, and its checker
  watchdog      hang detection: heartbeats, same-host kill of stopped ranks
  strategies    the Lightning strategy that ties them together
  callbacks     snapshots, epoch checks, boundary scheduling, fault injection, checkpoints
  loggers       CSV logs a new leader continues
  launcher/cli  lightning-recover launch | check-ledger | chaos | demo
  goodput       the discrete-event goodput model behind benchmarks/simulate.py
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy: the pure layers (policy, planner, ledger) must import without torch or MPI.
    if name == "ReCoVerHSDPStrategy":
        from lightning_recover.strategies import ReCoVerHSDPStrategy

        return ReCoVerHSDPStrategy
    raise AttributeError(name)
