"""The write fence: only the newest world of the newest launch writes the run's files.

The quorum rule (:mod:`lightning_recover.comm.quorum`) keeps a losing side of a cut from
training on. The fence keeps what is left of an older world from writing: a leader that
was frozen (SIGSTOP of its host, a stalled VM) between a commit and its ledger line and
is thawed after the others repaired, or a rank of an earlier launch still running when
the supervisor relaunched the job, both wake up sure they lead.

Contract:

* A fence is one small JSON file beside the outputs it guards (the ledger, the
  checkpoint directory): ``{"job": JOB, "epoch": E}``.
* The leader of a world :meth:`WorldFence.advance` s it when its world forms (job start,
  every repair, every re-join). A job's first world (epoch 0) takes the fence from any
  other job: a launch is newer than whatever wrote before it. Later worlds of a job only
  move their own job's fence forward, so an old launch's zombie never takes it back.
* A writer calls :meth:`WorldFence.allows` just before writing: it may write iff the fence
  is its job's and the fence's epoch is not newer than its own world epoch. A fence that
  is missing or unreadable allows (it is a guard against zombies, never a reason for a
  healthy job to stop).

The file is replaced atomically (write, fsync, rename), so a reader sees the old fence or
the new one. Between a check and the write there is a window (microseconds against the
seconds a failure takes to detect); closing it would need the storage's own fencing.

Pure Python: no MPI, no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FENCE_NAME", "Fence", "WorldFence"]

#: The fence file's name in a guarded directory.
FENCE_NAME = ".lightning-recover-fence.json"


@dataclass(frozen=True)
class Fence:
    job: str
    epoch: int


class WorldFence:
    """The fence file ``directory/FENCE_NAME``; see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / FENCE_NAME

    def read(self) -> Fence | None:
        try:
            raw = json.loads(self.path.read_text())
            return Fence(str(raw["job"]), int(raw["epoch"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def advance(self, job: str, epoch: int) -> None:
        """Take the fence for world ``epoch`` of ``job`` (see the module docstring for who may)."""
        if epoch < 0:
            raise ValueError(f"world epoch must be >= 0, got {epoch}")
        now = self.read()
        if now is not None and now.job == job and now.epoch >= epoch:
            return
        if now is not None and now.job != job and epoch > 0:
            return  # a world of an older launch, repaired while the newer one runs: it never takes the fence back
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"job": job, "epoch": epoch}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def allows(self, job: str, epoch: int) -> bool:
        """May world ``epoch`` of ``job`` write now?"""
        now = self.read()
        return now is None or (now.job == job and now.epoch <= epoch)

    def holder(self) -> str:
        """Who holds the fence, for error messages."""
        now = self.read()
        return "nobody" if now is None else f"job {now.job} at world epoch {now.epoch}"
