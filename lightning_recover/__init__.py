"""lightning-recover: survive replica failures in Lightning HSDP training without restarting.

Modules and packages, bottom up (``tests/inprocess/test_package_maps.py`` keeps this list complete):

  errors        RecoverError and the error model: what becomes of every exception
  _compat       torch version checks, in one table
  _lightning    every use of Lightning's private API, with its reason and the version checked
  topology      world rank <-> (replica, shard)
  config        RecoverConfig: every setting, validated once (ConfigurationError)
  mpi_wait      polite waits on MPI requests (oversubscribed hosts)
  netaddr       the address a replica's store listens on when it spans hosts
  quorum        the no-split-brain rule (pure): may this side of a failure go on?
  fence         write fences: a rank of an older world or launch never writes
  communicator  layer 1: fault-aware ULFM collectives and membership (world epochs, repair)
  data_plane    layer 1's bucket reductions over MPI, fault-aware
  lifecycle     a rank's start and end: crash hook, replica-consistency gate, markers, SIGTERM
  watchdog      hang detection: heartbeats, same-host kill of stopped or stuck ranks
  policy        layer 3: versatile workload (constant B, spares, boundary steps)
  planner       exactly-once microbatch ids -> samples, per-microbatch RNG
  data          step tickets and the microbatch source
  loading       the microbatch feed: Lightning's loader on the planner's ids
  evaluation    the evaluation split across live replicas
  ledger        one JSON line per committed step, the leader's writer, the checker
  report        lightning-recover report: a run's story from its ledger
  corruption    silent-data-corruption fingerprints (pure)
  recovery      layer 2: the step engine, its communicator contract, hooks, a fake world, the job
  process_group the "ulfm" torch.distributed group over layer 1 (strategy.replica_group)
  rejoin        hot re-join, the survivors' side: recruiter, standbys, admission, state transfer
  joiner        hot re-join, the replacement's side: merge, admission, then the user's script
  membership    hot re-join as a running job runs it: survivors admit, a replacement joins
  loggers       logs (CSV, TensorBoard) that survive a change of leader
  callbacks     recovery callbacks (reduction buffers, epoch and corruption checks, boundary
                scheduling), fault injection, fallback checkpoints
  strategies    the Lightning strategy: Lightning's hooks, delegating to the job and the engine
  supervision   supervised relaunch (pure): why a run ended, where it goes next
  slurm         Slurm: the allocation's hosts, refusing a direct srun
  launcher      lightning-recover launch: mpiexec with ULFM, markers, supervised relaunch
  cli           lightning-recover launch | check-ledger | report
  testing       fake hosts on one machine and the host-fault harness (tests, chaos campaign)

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
