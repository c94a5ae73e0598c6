"""The re-join handshake: the messages between the survivors and a replacement, and the replacement's half of it.

The survivors' half is :mod:`lightning_recover.membership.recruiter` (and, for warm
standbys, :mod:`lightning_recover.membership.standby`); the tags and words below are shared
by both halves. On the merged communicator (survivors first, the leader is rank 0)::

    HELLO     right after the merge, each replacement tells the leader its pid, start time
              and host (:func:`say_hello`), so that the leader can fence it if its attempt
              is dropped
    READY     the replacement's script built its model and optimizer (:func:`await_admission`)
    DECISION  the leader's answer to a READY replacement: GO (then the world grows) or ABORT

On a warm standby's link (the leader rank 0, then the standby's processes): HELLO after
the standby's merge with the leader, WARM once it imported, SEAT from the leader (JSON:
its seat, the port to connect to, or ``quit``; :func:`wait_on_link`), and CONNECT once
its script reached admission (:func:`connect`).

A replacement sends only to the leader (rank 0 of the merged communicator, or of its link).
The survivors send only to replacements whose READY (on a link: whose hello) reached them:
a first send to a process that died unreported waits forever on Open MPI 5.0.11 (see "What
a failing replacement costs" in :mod:`lightning_recover.membership.recruiter`). A
replacement whose survivors are gone gets an MPI error, or no answer at all, and its own
timer ends it (:mod:`lightning_recover.cli.joiner`); one that is not admitted
leaves quietly (:func:`give_up`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_recover.membership import milestones
from lightning_recover.membership.seat import Joining
from lightning_recover.runtime import lifecycle

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["await_admission", "connect", "give_up", "host_checksum", "say_hello", "tell_leader", "wait_on_link"]

TAG_READY = 7301
TAG_DECISION = 7302
TAG_HELLO = 7304
#: Standby <-> leader, on the standby's link (see "Warm standbys" in the standby module).
TAG_WARM = 7305
TAG_SEAT = 7306
TAG_CONNECT = 7307
GO, ABORT = 1, 0

#: Seconds between a waiting standby's looks at its link: it sleeps in between, so that it
#: takes no core from the training ranks (a blocking MPI wait would poll one at 100%).
STANDBY_POLL_S = 0.02


def _mpi() -> Any:
    """``mpi4py.MPI``, imported on first use: the import initializes MPI, which the joiner does itself first."""
    from mpi4py import MPI

    return MPI


def host_checksum() -> int:
    """This host's name as a number (what :func:`say_hello` sends; the leader compares it with its own)."""
    return zlib.crc32(socket.gethostname().encode())


def say_hello(merged: MPI.Intracomm) -> None:
    """Right after the merge, tell the leader who this process is (pid, start time, host), so that
    it can end this replacement if its attempt is dropped
    (see :meth:`~lightning_recover.membership.recruiter.Recruiter._fence`). Best effort."""
    MPI = _mpi()
    start = lifecycle.process_start_time(os.getpid())
    hello = np.array([os.getpid(), int(start) if start is not None and start.isdigit() else -1, host_checksum()], dtype=np.int64)
    try:
        merged.Send([hello, MPI.INT64_T], dest=0, tag=TAG_HELLO)
    except MPI.Exception:
        pass  # the leader is gone: the attempt is dropped, and the joiner's timer ends this process


def await_admission(joining: Joining, said_ready: Callable[[], None] = lambda: None) -> str:
    """Say READY to the survivors and wait for their decision: ``"go"`` (then :meth:`grow`), ``"abort"``
    (the survivors dropped the attempt), or ``"lost"`` when a member of the merged communicator
    died (the survivors' repair dropped the attempt; the joiner's timer bounds a wait nobody
    answers). ``said_ready`` runs in between (the ``join_ready`` fault point)."""
    MPI = _mpi()
    merged = joining.merged
    assert merged is not None, "await_admission before the replacement was merged (connect)"
    buf = np.zeros(1, dtype=np.int64)
    try:
        merged.Send([np.array([joining.rank], dtype=np.int64), MPI.INT64_T], dest=0, tag=TAG_READY)
        said_ready()
        merged.Recv([buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=TAG_DECISION)
    except MPI.Exception:
        return "lost"
    return "go" if int(buf[0]) == GO else "abort"


def wait_on_link(link: MPI.Intracomm, leader_alive: Callable[[], bool]) -> dict[str, Any] | None:
    """A standby's wait for the leader's next word (TAG_SEAT, JSON), sleeping between looks so that
    it takes no core from training; None when the leader is gone (an MPI error, or ``leader_alive``
    says so)."""
    MPI = _mpi()
    status = MPI.Status()
    checked = time.monotonic()
    while True:
        try:
            if link.Iprobe(source=0, tag=TAG_SEAT, status=status):
                data = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                link.Recv([data, MPI.BYTE], source=0, tag=TAG_SEAT)
                return dict(json.loads(data.tobytes().decode()))
        except MPI.Exception:
            return None
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if not leader_alive():
                return None
        time.sleep(STANDBY_POLL_S)


def tell_leader(link: MPI.Intracomm, tag: int) -> bool:
    """One small message to the leader on a standby's link; False if the leader is gone."""
    MPI = _mpi()
    try:
        link.Send([np.zeros(3, dtype=np.int64), MPI.INT64_T], dest=0, tag=tag)
    except MPI.Exception:
        return False
    return True


#: Set by the joiner for a standby's replacement: whether the leader that spawned it still runs.
leader_alive: Callable[[], bool] = lambda: True


def connect(joining: Joining) -> bool:
    """A standby's replacement, ready to be admitted: ask the leader to be merged, and merge.

    Sends TAG_CONNECT on the link, waits for the leader's port (the survivors START an attempt
    at their next step boundary and accept on it), connects and merges (survivors first), and
    says hello on the merged communicator. False when the leader is gone or sent ``quit``."""
    MPI = _mpi()
    link = joining.link
    assert link is not None, "connect() is for a standby's replacement"
    if not tell_leader(link, TAG_CONNECT):
        return False
    msg = wait_on_link(link, leader_alive)
    if msg is None or "port" not in msg:
        return False
    try:
        inter = MPI.COMM_WORLD.Connect(str(msg["port"]), root=0)
        merged = inter.Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
    except MPI.Exception:
        return False
    joining.merged = merged
    joining.seat = dataclasses.replace(joining.seat, attempt=int(msg["attempt"]))
    say_hello(merged)
    milestones.mark("connected")
    return True


def give_up(joining: Joining, reason: str) -> None:
    """A replacement that was not admitted leaves quietly: one stderr line, exit status 0."""
    print(f"[lightning-recover] replacement for rank {joining.rank}: {reason}; leaving", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)
