"""Test rigs shared by the launched tests and the chaos campaign; not shipped with the package.

They need root (network namespaces) or drive launched jobs, so they live beside the
campaign rather than in the wheel (``lightning_recover.testing`` keeps FakeWorld only).

  fake_cluster   fake hosts on one machine (network namespaces, own hostname and /dev/shm),
                 the launcher across them, host faults (ranks, whole host, freeze, partition, flap)
  fake_netns     the machine's side of fake hosts: unique names, subnet claims, the namespaces and
                 their processes, cleanup of what a dead instance left (MissingCapability, FakeClusterError)
  host_faults    applies FaultInjection's host-level kinds on fake hosts (the rank asks, the harness acts)
  campaign       the chaos campaign's draws, predictions and judgements (benchmarks/chaos.py drives it)
"""
