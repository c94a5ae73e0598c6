"""The launch side: the ``lightning-recover`` command and the supervisor around ``mpiexec``.

  __main__     ``python -m lightning_recover.cli``: the same as the ``lightning-recover`` command
  commands     lightning-recover launch | check-ledger | report
  launcher     lightning-recover launch: the job once, or supervised with relaunches from a checkpoint
  mpiexec      the mpiexec command line and environment that switch ULFM on
  runner       mpiexec in its own session, always ended: stuck aborts, finished worlds, stalls, signals
  job_status   the ranks' markers read back: the job's exit status and the launcher's last line
  hosts        this machine's names, the Slurm allocation's hosts, the reachability probe
  supervision  supervised relaunch (pure): why a run ended, where it goes next

Nothing in a rank's training path imports this layer; the ranks talk to it through
:mod:`lightning_recover.runtime.markers`.
"""
