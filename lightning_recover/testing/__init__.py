"""Test support that ships with the package: FakeWorld, N simulated replicas in one process.

A user's own tests of a recovery callback or a policy run the step engine against it, with
no MPI and no launcher (docs/callbacks.md). The rigs that need root or a launched job (fake
hosts on network namespaces, the host-fault harness, the chaos campaign's draws) are not
shipped: they live under ``benchmarks/rigs/``, beside the campaign that drives them.

  fake             FakeWorld: N simulated replicas in one process (engine tests), each rank's FakeComm
  fake_rendezvous  the simulated world's ULFM core: one lock, memberships, deaths, the rendezvous
  fake_faults      the simulated world's failure script (Kill) and how a simulated rank ends (Died)
"""
