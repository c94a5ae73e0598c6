"""ReCoVer's fault-aware collectives: communication over ULFM MPI, and the contract the step engine sees of it.

  topology       world rank <-> (replica, shard)
  ulfm           whether this MPI and launch have ULFM; which MPI errors mean a peer died
  repair_bound   the bound on a repair or agreement: a rank that cannot finish one leaves
  netaddr        the address a replica's store listens on when it spans hosts
  mpi_wait       polite waits on MPI requests (oversubscribed hosts)
  quorum         the no-split-brain rule (pure): may this side of a failure go on?
  quorum_watch   a rank that already knows its side lost quorum leaves, wherever it waits
  buckets        gradient buckets tagged with the world epoch they were reduced in
  interface      the communicator contract (ReplicaComm, PeerFailure, RepairResult)
  data_plane     the data-plane contract and the bucket reductions over MPI, fault-aware
  torch_plane    the bucket reductions over torch.distributed (gloo, NCCL), watched by ULFM
  collectives    the communicator's reductions, broadcasts and gathers
  lobby          salvage: the shrunk communicator an orphan keeps, and Orphaned
  communicator   FaultTolerantComm: membership (world epochs, agreement, repair, grow)
  orphans        salvage: the survivors seat orphans as a re-formed replica, the orphans' side of it
  process_group  the "ulfm" torch.distributed group over the communicator (strategy.replica_group)
  replica_plane  the replica-local collectives over MPI (all-gather, reduce-scatter)

Nothing here imports Lightning; importing a module does not initialize MPI. The communicator
imports no torch (torch_plane, process_group and replica_plane do).
"""
