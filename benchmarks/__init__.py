"""The checkout's benchmarks and chaos campaign: run each as ``python -m benchmarks.NAME`` from the root.

Not shipped with the package (pyproject's ``packages.find`` takes ``lightning_recover*`` only):
these measure it, from a source checkout, with the example models of ``examples/``. Every
script prints its ratios measured side by side in one run, the headline ratio last.

Measurements (each a ``python -m`` entry point)
  overhead, step_cost, sdc_overhead, checkpoint_save, dataloader_workers   fault-free step cost
  goodput, peers, rejoin, mixed_world                                     under real kills, vs peers
  allreduce, scaling, control_plane, scale                                how costs grow with the job
  simulate                                                                goodput at 10^3-10^5 GPUs, modelled
  chaos                                                                   the chaos campaign (every run judged)
  trajectories                                                            bitwise before/after check of a refactor
  gpu_check                                                               the one-command check for a lent GPU

What they share
  common, proctree                 launch a measured job, end its whole process tree, judge the machine's load
  bench_job, scaling_rank,         the launched ranks' scripts (run by path, with the checkout's root
  control_plane_rank,              on PYTHONPATH)
  peers_torchft_worker
  mpi_counter                      counts a rank's MPI calls and bytes per phase
  goodput_model, control_plane_model   the models simulate.py extrapolates with
  rigs/                            fake hosts (network namespaces, root), the host-fault harness, the chaos
                                   campaign's draws and verdicts: shared with the launched tests
"""
