"""lightning-recover: survive replica failures in Lightning HSDP training without restarting.

Layers, bottom up: a module imports only from its own layer or the ones listed before it
(``tests/inprocess/test_layers.py`` checks it). Each package's docstring maps its modules
(``tests/inprocess/test_package_maps.py`` keeps the maps complete).

  errors      RecoverError and the error model: what becomes of every exception
  _compat     torch version checks, in one table
  _lightning  every use of Lightning's private API, with its reason and the version checked
  config      RecoverConfig: every setting, validated once (ConfigurationError)
  workload    ReCoVer's versatile workload (pure): the workload policy and the exactly-once microbatch planner
  audit       the step ledger, its report, corruption fingerprints, write fences
  runtime     a rank's process: start and end, status markers, Slurm, the hang watchdog
  comm        ReCoVer's fault-aware collectives: ULFM collectives and membership, data planes, the "ulfm" process group
  membership  hot re-join: the survivors' side and the replacement's side
  recovery    ReCoVer's in-step recovery: the step engine, its state and hooks, the overlapped reduction, the
              running job (RecoveryJob) and the admission of replacements at a boundary
  feed        exactly-once data: the microbatch feed and the evaluation split
  callbacks   recovery callbacks, fault injection, fallback checkpoints, leader-safe loggers
  strategies  the Lightning strategy: Lightning's hooks, delegating to the step engine
  testing     the simulated world, fake hosts on one machine, the host-fault harness
  cli         the launch side: lightning-recover launch | check-ledger | report, supervision

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
