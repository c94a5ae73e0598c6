"""A rank's process: how it starts and leaves, what it tells the launcher, how a hang ends.

  markers    the status-marker names shared by the ranks and the launcher
  slurm      what the environment tells of Slurm; refusing a direct srun start
  lifecycle  a rank's start and end: crash hook, replica-consistency gate, markers, SIGTERM
  refusal    a setting refused in a launched rank: one line naming it and the fix, exit status 2
  watchdog   hang detection: heartbeats, same-host kill of stopped or stuck ranks
  priority   a warm standby's CPU priority: idle while it imports beside training, promoted when needed

Below the communicator: it leaves through :mod:`lightning_recover.runtime.lifecycle`'s exits,
and this layer never imports the communicator, nor the launch side it talks to through markers.
"""
