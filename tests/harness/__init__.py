"""The test suite's shared harness, imported by the in-process and the launched tests alike.

:mod:`harness.mpirun` launches real mpiexec jobs of the ``tests/workers`` scripts through
the project's launcher, with hard timeouts; :mod:`harness.slurm_cluster` starts a real
one-node Slurm; :mod:`harness.fake_hosts` probes the fake hosts of
:mod:`benchmarks.rigs.fake_cluster`; :mod:`harness.engine_steps` holds the
simulated gradients and losses the FakeWorld suites of the step engine share, so their
runs compare. pytest's ``pythonpath`` (pyproject.toml) puts ``tests/`` on the path, which makes this
package importable as ``harness`` from every test folder.
"""
