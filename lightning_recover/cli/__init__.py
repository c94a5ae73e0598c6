"""The launch side: the ``lightning-recover`` command and the supervisor around ``mpiexec``.

  __main__     ``python -m lightning_recover.cli``: the same as the ``lightning-recover`` command
  commands     lightning-recover launch | check-ledger | report
  launcher     lightning-recover launch: the job once, or supervised with relaunches from a checkpoint
  console      what of the job's output reaches the console: Open MPI's NBC error lines left out, counted
  mpiexec      the mpiexec command line and environment that switch ULFM on
  runner       mpiexec in its own session, always ended: stuck aborts, finished worlds, stalls, signals
  job_status   the ranks' markers read back: the job's exit status and the launcher's last line
  startup      the watch over a job's start: a rank lost before its communicator ends the job with one line
  hosts        this machine's names, the Slurm allocation's hosts, the reachability probe
  supervision  supervised relaunch (pure): why a run ended, where it goes next
  joiner       a replacement's or warm standby's entry point (spawned by the survivors): merge,
               admission, then the user's script

Nothing in a rank's training path imports this layer (a replacement *starts* in joiner, which
then runs the user's script); the ranks talk to the launcher through
:mod:`lightning_recover.runtime.markers`.
"""
