"""ReCoVer's in-step recovery: the step engine and what it keeps of a step.

The communicator contract it runs against (:mod:`lightning_recover.comm.interface`,
:mod:`lightning_recover.comm.buckets`) belongs to the collectives; the simulated world that keeps it
in one process is :mod:`lightning_recover.testing.fake`.

  state       StepState: everything one optimizer step knows, in one object
  hooks       the recovery hooks callbacks implement, their typed calls, the collectives a hook gets
  engine      StepEngine: plan, compute, reduce, agree, repair, replay, commit
  overlap     the overlapped reduction: buckets reduced while backward runs
  step_values the step's loss and logged values, summed once at the commit
  job         RecoveryJob: one rank's running job (build, start, resume, re-join, close)
  rejoin      re-join as the running job runs it: survivors admit ready replacements and
              send the live state; a replacement waits for its GO and receives it

Nothing here imports Lightning; only job imports MPI, when it starts a rank.
"""
