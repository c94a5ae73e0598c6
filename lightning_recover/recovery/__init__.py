"""In-step recovery (layer 2): the step engine and the contracts it runs against.

  buckets     gradient buckets tagged with the world epoch they were reduced in
  interface   the communicator contract (ReplicaComm, PeerFailure, RepairResult)
  state       StepState: everything one optimizer step knows, in one object
  hooks       the recovery hooks callbacks implement, and their dispatch
  engine      StepEngine: plan, compute, reduce, agree, repair, replay, commit
  overlap     the overlapped reduction: buckets reduced while backward runs
  step_values the step's loss and logged values, summed once at the commit
  fake        FakeWorld: N simulated replicas in one process, scripted failures (tests)
  job         RecoveryJob: one rank's running job (build, start, resume, re-join, close)

Nothing here imports Lightning; only job imports MPI, when it starts a rank.
"""
