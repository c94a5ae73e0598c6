"""ReCoVer's versatile workload (pure): who computes which microbatches, and which samples they hold.

  step_plan       what a policy decides: roles, each replica's share of a step, the commit record, errors
  policy          the protocol every policy keeps (begin_step -> fail* -> commit, join at a boundary)
  static_world    versatile workload: constant B, spares, boundary steps
  adaptive_world  the torchft-like ablation: fixed ownership, the batch shrinks with each loss
  factory         make_policy: the policy a run's settings name (recover.policy)
  planner         exactly-once microbatch ids -> samples, per-microbatch RNG

Nothing here imports torch.distributed, MPI or Lightning: the policies are decided the same
way on every rank from the same membership events, and are tested without a world.
"""
