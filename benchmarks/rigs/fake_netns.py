"""The machine's side of fake hosts: unique names, subnet claims, network namespaces and their processes.

Role: test support under :mod:`benchmarks.rigs.fake_cluster`, which builds the fake
hosts out of what this module provides. Every name a fake cluster creates on the machine
(network namespaces, links, ``/etc/netns`` entries) starts with a prefix naming its owner
process (:func:`new_prefix`), and each instance claims its private ``10.77.K.0/24`` with an
exclusive file under :data:`CLAIMS`, so concurrent instances never collide and
:func:`cleanup_stale` can remove what an instance whose process died left behind. A test of
host faults must never leak a namespace or a process into the next one: killing a
namespace's processes (:func:`kill_namespace_processes`) loops until none is left.
The process probes (:func:`environ_of`, :func:`comm_of`, :func:`state_of`) read ``/proc``,
so the harness can tell a host's ranks from Open MPI's daemons, and a frozen rank.

Needs root, ``ip`` (iproute2), ``unshare``, ``nsenter`` and ``setsid`` (util-linux): a missing one
is a :class:`MissingCapability` naming it (:func:`check_capabilities`), never a silent skip.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path


__all__ = [
    "CLAIMS", "FakeClusterError", "MissingCapability", "NAME_ROOT", "SUBNET_BASE", "check_capabilities", "claim_subnet",
    "cleanup_stale", "comm_of", "delete_instance_names", "environ_of", "kill_namespace_processes", "netns_list", "netns_pids",
    "new_prefix", "run_command", "signal_all", "state_of",
]

#: Every name an instance creates (namespaces, links, ``/etc/netns`` entries) starts with this.
NAME_ROOT = "lrfc"
#: Subnet claims of live instances (one file per claimed ``10.77.K.0/24``, holding the owner's prefix).
CLAIMS = Path("/run/lightning-recover-fake-cluster")
#: First two octets of every fake subnet.
SUBNET_BASE = "10.77"

_PID_DIGITS = 5  # base-36 digits of the owner pid in a prefix: 36**5 > 2**22 (Linux's pid_max cap)
_sequence = 0
_sequence_lock = threading.Lock()


class MissingCapability(RuntimeError):
    """The machine cannot build fake hosts (not root, or a tool is missing); the message names it."""


class FakeClusterError(RuntimeError):
    """A fake-cluster operation failed; the message names the command and its output."""


def _b36(value: int, width: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while value:
        value, d = divmod(value, 36)
        out = digits[d] + out
    return out.rjust(width, "0")


def _owner_pid(prefix: str) -> int | None:
    """The pid of the process that created ``prefix`` (see :func:`new_prefix`), or None if it is not one of ours."""
    if not prefix.startswith(NAME_ROOT) or len(prefix) < len(NAME_ROOT) + _PID_DIGITS + 1:
        return None
    try:
        return int(prefix[len(NAME_ROOT) : len(NAME_ROOT) + _PID_DIGITS], 36)
    except ValueError:
        return None


def new_prefix() -> str:
    """A name prefix unique to this process and instance: ``lrfc`` + owner pid (5 base-36 digits) + a sequence letter.

    10 characters, so every link name built on it stays within Linux's 15."""
    global _sequence
    with _sequence_lock:
        seq, _sequence = _sequence, _sequence + 1
    return f"{NAME_ROOT}{_b36(os.getpid(), _PID_DIGITS)}{_b36(seq % 36, 1)}"


def check_capabilities() -> None:
    """Raise :class:`MissingCapability` naming everything missing to build fake hosts."""
    missing = []
    if os.geteuid() != 0:
        missing.append(f"root (running as uid {os.geteuid()}; network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN: run as root)")
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux"), ("setsid", "util-linux")):
        if shutil.which(tool) is None:
            missing.append(f"the '{tool}' command (install {package})")
    if missing:
        raise MissingCapability("fake hosts cannot be built here: missing " + "; ".join(missing))


def run_command(argv: Sequence[str], *, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """Run a tool (``ip`` ...) and capture its output; :class:`FakeClusterError` naming it if it fails (``check``) or hangs."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise FakeClusterError(f"{shlex.join(argv)} did not return in {timeout}s") from exc
    if check and proc.returncode != 0:
        raise FakeClusterError(f"{shlex.join(argv)} failed with status {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def netns_list() -> list[str]:
    """Names of the machine's network namespaces (``ip netns list``)."""
    out = run_command(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    """Processes in ``netns`` (``ip netns pids``); empty when the namespace is gone."""
    proc = run_command(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def kill_namespace_processes(netns: str, deadline_s: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` (SIGCONT first, for stopped ones) until none is left: a
    process may fork while we kill, so this loops; zombies hold no namespace and are not listed."""
    deadline = time.monotonic() + deadline_s
    while True:
        pids = [p for p in netns_pids(netns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            raise FakeClusterError(f"processes {pids} in namespace {netns} survived SIGKILL for {deadline_s}s")
        time.sleep(0.05)


def delete_instance_names(prefix: str) -> None:
    """Kill the processes of, and delete, every namespace and /etc/netns entry named ``prefix*``."""
    for ns in netns_list():
        if ns.startswith(prefix):
            kill_namespace_processes(ns)
            run_command(["ip", "netns", "del", ns], check=False)
    etc = Path("/etc/netns")
    if etc.is_dir():
        for entry in etc.iterdir():
            if entry.name.startswith(prefix):
                shutil.rmtree(entry, ignore_errors=True)
    if CLAIMS.is_dir():
        for claim in CLAIMS.iterdir():
            try:
                if claim.read_text().strip() == prefix:
                    claim.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove what instances whose owner process is gone left behind (a SIGKILLed test run); returns their prefixes."""
    prefixes = {ns[: len(NAME_ROOT) + _PID_DIGITS + 1] for ns in netns_list() if ns.startswith(NAME_ROOT)}
    etc = Path("/etc/netns")
    if etc.is_dir():
        prefixes |= {e.name[: len(NAME_ROOT) + _PID_DIGITS + 1] for e in etc.iterdir() if e.name.startswith(NAME_ROOT)}
    if CLAIMS.is_dir():
        for claim in CLAIMS.iterdir():
            try:
                prefixes.add(claim.read_text().strip())
            except OSError:
                pass
    stale = sorted(p for p in prefixes if (owner := _owner_pid(p)) is not None and not _alive(owner))
    for prefix in stale:
        delete_instance_names(prefix)
    return stale


def claim_subnet(prefix: str) -> int:
    """Claim a free ``K`` for ``10.77.K.0/24`` (an exclusive file under :data:`CLAIMS`); reclaims those of dead owners."""
    CLAIMS.mkdir(parents=True, exist_ok=True)
    for k in range(256):
        path = CLAIMS / f"subnet-{k}"
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = _owner_pid(path.read_text().strip())
                except OSError:
                    owner = None
                if owner is not None and not _alive(owner):
                    path.unlink(missing_ok=True)  # a dead instance's claim: take it over
                    continue
                break
            with os.fdopen(fd, "w") as f:
                f.write(prefix + "\n")
            return k
    raise FakeClusterError(f"no free subnet {SUBNET_BASE}.K.0/24 (all 256 claimed under {CLAIMS}); run cleanup_stale() or remove stale claims")


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each of ``pids``; one that is already gone is skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def environ_of(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with (``/proc/PID/environ``); empty once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def comm_of(pid: int) -> str:
    """The command name of ``pid`` (``/proc/PID/comm``); empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def state_of(pid: int) -> str:
    """The scheduler state letter of ``pid`` (``/proc/PID/stat``: ``S``, ``T`` for stopped ...); empty once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :].split()[0]
