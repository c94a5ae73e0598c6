"""The launch side: the ``lightning-recover`` command and the supervisor around ``mpiexec``.

  __main__     ``python -m lightning_recover.cli``: the same as the ``lightning-recover`` command
  commands     lightning-recover launch | check-ledger | report
  launcher     lightning-recover launch: mpiexec with ULFM, markers, supervised relaunch
  supervision  supervised relaunch (pure): why a run ended, where it goes next

Nothing in a rank's training path imports this layer; the ranks talk to it through
:mod:`lightning_recover.runtime.markers`.
"""
