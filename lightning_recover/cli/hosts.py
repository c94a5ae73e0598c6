"""The hosts a job may run on, as this machine sees them: its own names, the Slurm allocation, a reachability probe.

The supervised relaunch (:func:`lightning_recover.cli.launcher.supervise`) drops every host
that stops answering before it relaunches a job, and the plain launch needs to know whether
a host list is only this machine (then the stuck-abort rule of
:mod:`lightning_recover.cli.runner` sees every rank). These functions run commands
(``ssh`` or ``srun``, ``scontrol``) and read the environment; the pure parsing of host lists and
Slurm's counts lives in :mod:`lightning_recover.cli.supervision`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence

from lightning_recover.cli.supervision import Host, slurm_hosts


def local_host_names() -> frozenset[str]:
    """Names under which this machine may appear in a host list (never probed: the supervisor runs here)."""
    import socket

    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return frozenset(names | {n.split(".", 1)[0] for n in names})


#: How the probe reaches a node of the Slurm allocation it runs in: a one-task step on that node
#: (the host name follows), sharing the job's resources (``--overlap``), without Slurm's MPI
#: plugin. It is the path Open MPI's runtime takes there (its Slurm launcher starts its daemons
#: with srun), and it needs no ssh between nodes, which many clusters do not allow.
SRUN_PROBE = ("srun", "--overlap", "--nodes=1", "--ntasks=1", "--mpi=none", "--quiet", "--nodelist")


def remote_agent(extra: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The command mpiexec reaches other hosts with: its ``plm_ssh_agent`` when given in ``extra``; inside a
    Slurm allocation (``SLURM_JOB_ID`` in ``env``) where ``srun`` is found and the user did not choose
    Open MPI's ssh launcher (``plm ssh``), :data:`SRUN_PROBE`; else ssh."""
    env = os.environ if env is None else env
    chose_ssh = False
    for i, arg in enumerate(extra[:-1]):
        if arg in ("--prtemca", "--mca") and i + 2 < len(extra) and extra[i + 1] == "plm_ssh_agent":
            return shlex.split(extra[i + 2])
        if arg in ("--prtemca", "--mca") and extra[i + 1] == "plm" and i + 2 < len(extra):
            chose_ssh = extra[i + 2] in ("ssh", "rsh")
    if "SLURM_JOB_ID" in env and not chose_ssh and shutil.which("srun", path=env.get("PATH")) is not None:
        return list(SRUN_PROBE)
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]


def probe_unreachable(hosts: Sequence[Host], extra: Sequence[str] = (), timeout_s: float = 15.0) -> frozenset[str]:
    """The hosts that do not run ``true`` through mpiexec's remote agent within ``timeout_s`` (in parallel).

    This machine's own names are never probed. A host that answers may still have lost its
    daemon; a relaunch places a new one there, which is what PRRTE needs.
    """
    agent = remote_agent(extra)
    local = local_host_names()
    result: dict[str, bool] = {}

    def one(name: str) -> None:
        try:
            done = subprocess.run([*agent, name, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=timeout_s)
            result[name] = done.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            result[name] = False

    threads = [threading.Thread(target=one, args=(h.name,), daemon=True) for h in hosts if h.name not in local]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return frozenset(h.name for h in hosts if h.name not in local and not result.get(h.name, False))


def slurm_allocation(env: Mapping[str, str] | None = None) -> tuple[Host, ...] | None:
    """The hosts of the Slurm allocation this runs in (``scontrol show hostnames``), or None outside one.

    Slots per host come from ``SLURM_TASKS_PER_NODE`` (else ``SLURM_JOB_CPUS_PER_NODE``).
    """
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    per_node = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE")
    if not per_node:
        raise ValueError("inside a Slurm allocation without SLURM_TASKS_PER_NODE or SLURM_JOB_CPUS_PER_NODE; give --hosts explicitly")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"'scontrol show hostnames {nodelist}' failed ({exc}); give --hosts explicitly") from None
    return slurm_hosts(out.split(), per_node)
