"""lightning-recover: survive replica failures in Lightning HSDP training without restarting.

Layers (see DESIGN.md), bottom up:
  topology      world rank <-> (replica, shard)
  config        RecoverConfig: every setting, validated once (ConfigurationError)
  communicator  layer 1: fault-aware ULFM collectives and membership (world epochs, repair)
  lifecycle     a rank's start and end: crash hook, replica-consistency gate, fencing, markers
  watchdog      hang detection: heartbeats, same-host kill of stopped or stuck ranks
  policy        layer 3: versatile workload (constant B, spares, boundary steps)
  planner       exactly-once microbatch ids -> samples, per-microbatch RNG
  data          step tickets and the microbatch source
  ledger        one JSON line per committed step, the leader's writer, the checker
  recovery      layer 2: the step engine, its communicator contract, hooks and a fake world
  callbacks     recovery callbacks (reduction buffers, epoch check, boundary scheduling),
                fault injection, fallback checkpoints
  strategies    the Lightning strategy: Lightning's hooks, delegating to the step engine
  process_group the "ulfm" torch.distributed group over layer 1 (strategy.replica_group)
  loggers       logs (CSV, TensorBoard) that survive a change of leader
  launcher/cli  lightning-recover launch | check-ledger

The demo (examples/demo.py), the chaos campaign (benchmarks/chaos.py) and the goodput
model (benchmarks/goodput_model.py) are tools of the source checkout, not of the package.
Importing any module changes no process-wide state; setting up the strategy does.
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy: the pure layers (policy, planner, ledger, config) must import without torch or MPI.
    if name == "ReCoVerHSDPStrategy":
        from lightning_recover.strategies import ReCoVerHSDPStrategy

        return ReCoVerHSDPStrategy
    if name == "RecoverConfig":
        from lightning_recover.config import RecoverConfig

        return RecoverConfig
    raise AttributeError(name)
