"""The bound on a repair or an agreement: a rank whose repair never returns leaves, the job never hangs (ReCoVer's fault-aware collectives).

ULFM's agreement can wait for good (seen when the middle one of 3 fake hosts was cut off,
its ranks declared dead one at a time). The communicator therefore runs every repair and
agreement inside :meth:`RepairBound.within`; a section that outlasts
``$LIGHTNING_RECOVER_REPAIR_TIMEOUT`` seconds (:func:`repair_timeout`, 300 by default)
ends the rank as a side without quorum does
(:func:`lightning_recover.runtime.lifecycle.quorum_exit`), so that a supervising launcher
relaunches the job.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["DEFAULT_REPAIR_TIMEOUT_S", "ENV_REPAIR_TIMEOUT", "RepairBound", "repair_timeout"]

#: Environment variable: the bound (seconds) on one repair; default :data:`DEFAULT_REPAIR_TIMEOUT_S`.
ENV_REPAIR_TIMEOUT = "LIGHTNING_RECOVER_REPAIR_TIMEOUT"
#: Detector-declared deaths shrink at about the detector timeout per failed rank: room for dozens.
DEFAULT_REPAIR_TIMEOUT_S = 300.0


def repair_timeout() -> float:
    """``$LIGHTNING_RECOVER_REPAIR_TIMEOUT`` seconds, else :data:`DEFAULT_REPAIR_TIMEOUT_S`."""
    raw = os.environ.get(ENV_REPAIR_TIMEOUT, "")
    try:
        value = float(raw) if raw else DEFAULT_REPAIR_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV_REPAIR_TIMEOUT}={raw!r} must be a positive number of seconds, e.g. 300")
    return value


class RepairBound:
    """Ends the rank (``leave(reason)``) when a section entered with :meth:`within` outlasts ``seconds``.

    One daemon thread per communicator, started at the first section and polling once a
    second, so the per-step agreement pays two attribute writes, not a timer thread."""

    def __init__(self, seconds: float, leave: Callable[[str], None]) -> None:
        self.seconds = seconds
        self._leave = leave
        self._section: tuple[float, str] | None = None  # (deadline, what): one tuple, swapped atomically
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def within(self, what: str) -> Iterator[None]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="lightning-recover-bound", daemon=True)
            self._thread.start()
        outer = self._section  # a repair's agreements sit inside the repair's own bound
        if outer is None:
            self._section = (time.monotonic() + self.seconds, what)
        try:
            yield
        finally:
            self._section = outer

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            section = self._section
            if section is not None and time.monotonic() > section[0]:
                self._leave(
                    f"{section[1]} did not finish within {self.seconds:g} s (an agreement that does not return; "
                    f"{ENV_REPAIR_TIMEOUT} sets the bound)"
                )
