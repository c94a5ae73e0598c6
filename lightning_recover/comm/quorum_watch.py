"""The quorum watch: a rank that already knows its side of a cut has lost leaves at once, wherever it waits.

A repair asks the quorum rule (:mod:`lightning_recover.comm.quorum`) which side goes on, and
the repair's time bound (:mod:`lightning_recover.comm.repair_bound`) ends a rank whose
agreement never returns. Neither helps a rank that waits *outside* a repair for a peer no
failure detector watches: Open MPI's heartbeat ring covers the launch's own processes, never
a spawned replacement. In the host salvage campaign a host was cut off while its rank shared
a replica with a rank spawned on the spare host: the cut-off rank learnt within seconds that
every other launch rank was dead, yet stayed blocked in a collective with the spawned one,
and never left (``--hosts 3 --salvage --seed 949``, run 18).

So a daemon thread reads, once a second, the deaths this rank already knows of (ULFM's
``Get_failed``; never acknowledged, the next agreement must still see them) and asks the
rule the next repair will ask. It drives no MPI progress of its own: a rank blocked in a wait
drives it (that is how it learns of the deaths), and one busy in compute learns of them at
its next MPI call, as it always did. When the answer is "no quorum" on two reads in a row of the
same world, the rank leaves as a side without quorum does
(:func:`lightning_recover.runtime.lifecycle.quorum_exit`). The two reads leave a rank that
is about to repair (milliseconds on one host) to reach the same verdict the usual way.

Why leaving early never stops a side that would have gone on: a rank knows of fewer deaths
than any repair to come will use (ULFM never revives a rank it declared dead). With more
deaths the survivors can only shrink, and a lost replica that this view finds uncertain (no
survivor on the host of its lost ranks) stays uncertain, so the contenders can only grow:
if this view already fails the rule, every later one does too (the property test checks it
on arbitrary views).

The watch never runs while the world changes: a repair or a join holds :attr:`QuorumWatch.lock`,
and a read that finds it taken is skipped, so no verdict mixes two worlds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["QuorumWatch"]


class QuorumWatch:
    """Calls ``leave(reason)`` once ``verdict()`` returned the same world's "no quorum" twice in a row.

    ``verdict()`` returns ``None`` while the side may go on (or has no world), else
    ``(world_key, reason)``; ``world_key`` changes with every world (its epoch)."""

    def __init__(self, verdict: Callable[[], tuple[object, str] | None], leave: Callable[[str], None], period_s: float = 1.0) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be a positive number of seconds, got {period_s!r}")
        self.period_s = period_s
        self._verdict = verdict
        self._leave = leave
        #: Held by whoever changes the world (a repair, a join); the watch skips a read while it is taken.
        self.lock = threading.Lock()
        self._seen: object | None = None  # the world whose "no quorum" the previous read found
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the watch's daemon thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightning-recover-quorum-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """No read after this returns (the world is about to be freed)."""
        self._stopped.set()
        with self.lock:
            pass

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Hold the watch off while the world changes."""
        with self.lock:
            yield
        self._seen = None

    def poll(self) -> str | None:
        """One read: the reason to leave when this is the second "no quorum" of one world in a row, else None."""
        if self._stopped.is_set() or not self.lock.acquire(blocking=False):
            return None
        try:
            found = self._verdict()
        finally:
            self.lock.release()
        if found is None:
            self._seen = None
            return None
        key, reason = found
        if self._seen is not None and self._seen == key:
            return reason
        self._seen = key
        return None

    def _run(self) -> None:
        while not self._stopped.wait(self.period_s):
            reason = self.poll()
            if reason is not None:
                self._leave(reason)
                return
