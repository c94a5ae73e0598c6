"""The run's evidence and its guards: what proves a run exact, and what keeps stale ranks from writing.

  ledger         the step ledger's format: one JSON line per committed step, and its reader
  ledger_writer  the leader's writer: each line written at once, fsync'ed behind
  ledger_check   check-ledger: exactly-once ids, constant B, losses vs a reference
  report         lightning-recover report: a run's story from its ledger
  corruption     silent-data-corruption fingerprints and the arbitration among replicas (pure)
  fence          write fences: a rank of an older world or launch never writes

Nothing here imports torch.distributed or MPI: the checks run on any machine, on a run's files.
"""
