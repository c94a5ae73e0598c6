"""Test support for lightning-recover, shipped with the package so that the test suite and the
chaos campaign (``benchmarks/chaos.py``) share one implementation.

:mod:`lightning_recover.testing.fake_cluster` builds fake hosts on one Linux machine (network
namespaces on a private bridge, each with its own hostname and ``/dev/shm``), runs the
project's launcher across them, and injects host-level faults: all ranks of a host killed,
the whole host lost with Open MPI's daemon, a frozen host, a partitioned or flapping link.
Nothing here is imported by the training path.

  fake             FakeWorld: N simulated replicas in one process (engine tests), each rank's FakeComm
  fake_rendezvous  the simulated world's ULFM core: one lock, memberships, deaths, the rendezvous
  fake_faults      the simulated world's failure script (Kill) and how a simulated rank ends (Died)
  fake_cluster     fake hosts on one machine (network namespaces), the launcher across them, host faults
  fake_netns       the machine's side of fake hosts: names, subnet claims, namespaces, their processes, cleanup
  host_faults      the host-fault harness: applies the host faults ranks ask for, on fake hosts
  chaos            the chaos campaign's draws, predictions and judgements (benchmarks/chaos.py, tests)
"""
