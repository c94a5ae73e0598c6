"""Layer 1: fault-aware communication over ULFM MPI, and the contract the step engine sees of it.

  topology       world rank <-> (replica, shard)
  netaddr        the address a replica's store listens on when it spans hosts
  mpi_wait       polite waits on MPI requests (oversubscribed hosts)
  quorum         the no-split-brain rule (pure): may this side of a failure go on?
  buckets        gradient buckets tagged with the world epoch they were reduced in
  interface      the communicator contract (ReplicaComm, PeerFailure, RepairResult)
  data_plane     the bucket reductions over MPI or torch.distributed, fault-aware
  communicator   FaultTolerantComm: collectives and membership (world epochs, repair)
  process_group  the "ulfm" torch.distributed group over the communicator (strategy.replica_group)
  replica_plane  the replica-local collectives over MPI (all-gather, reduce-scatter)

Nothing here imports Lightning; importing a module does not initialize MPI.
"""
