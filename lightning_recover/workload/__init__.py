"""The workload (layer 3, pure): who computes which microbatches, and which samples they hold.

  policy   versatile workload: constant B, spares, boundary steps
  planner  exactly-once microbatch ids -> samples, per-microbatch RNG

Nothing here imports torch.distributed, MPI or Lightning: the policies are decided the same
way on every rank from the same membership events, and are tested without a world.
"""
