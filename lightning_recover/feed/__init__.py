"""Exactly-once data: the planner's microbatches through the user's loaders, and the evaluation split.

  loading     the microbatch feed: Lightning's loader on the planner's ids, worker prefetch
  data        step tickets and the microbatch source
  evaluation  the evaluation split across live replicas

Nothing here imports Lightning or MPI.
"""
