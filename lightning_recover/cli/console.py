"""What of a job's output reaches the user's console: Open MPI's internal NBC error lines are left out, and counted.

When a peer dies inside a non-blocking collective, Open MPI's libnbc prints, on every
rank that had one in flight, ``NBC_Progress: an error 75 was found during schedule 0x...
at row-offset 0 - aborting the schedule`` (often followed by an empty line) and ``Error in
NBC_Start_round() (-1)``. They say nothing the user can act on: the survivors repair in
place and print the project's own lines (what was lost, the repair, its cost). The launcher
passes the job's output through :class:`ConsoleFilter`, which drops those lines (and the
empty line right after one) and counts them; the launcher says how many at the end
(:func:`summary`).

The filter works on bytes as they arrive. A complete line is passed on or dropped; the
start of a line that could still become an NBC line is held until its end (a few dozen
bytes); any other partial line (a progress bar redrawn with ``\\r``) is passed on at once.
"""

from __future__ import annotations

import re

__all__ = ["NBC_LINE", "ConsoleFilter", "summary"]

#: The two lines libnbc prints for a schedule a failed peer cut short.
NBC_LINE = re.compile(rb"NBC_Progress: an error -?\d+ was found during schedule|Error in NBC_Start_round\(\)")
# The starts such a line can have: a partial line that is a prefix of one is held until its end.
_STARTS = (b"NBC_Progress: an error ", b"Error in NBC_Start_round()")
# A held partial line longer than this is no NBC line any more: pass it on.
_HOLD_MAX = 512


def _could_become_nbc(partial: bytes) -> bool:
    return any(start.startswith(partial[: len(start)]) for start in _STARTS) and len(partial) <= _HOLD_MAX


class ConsoleFilter:
    """Drops Open MPI's NBC error lines from one output stream; see the module docstring."""

    def __init__(self) -> None:
        self.dropped = 0
        self._held = b""
        self._mid_line = False  # a partial line was passed on: the rest of it passes too
        self._after_drop = False  # the line before was dropped: an empty line now is its trailer

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` (with what was held back before) goes on to the console now."""
        data, self._held = self._held + chunk, b""
        out: list[bytes] = []
        while data:
            end = data.find(b"\n")
            if end < 0:
                if not self._mid_line and _could_become_nbc(data):
                    self._held = data
                else:
                    out.append(data)
                    self._mid_line = True
                    self._after_drop = False
                break
            line, data = data[: end + 1], data[end + 1 :]
            if self._mid_line:
                out.append(line)
                self._mid_line = False
            elif NBC_LINE.search(line):
                self.dropped += 1
                self._after_drop = True
                continue
            elif self._after_drop and not line.strip():
                pass  # libnbc's empty line after its message
            else:
                out.append(line)
            self._after_drop = False
        return b"".join(out)

    def flush(self) -> bytes:
        """The end of the stream: what was held back (an unfinished line) goes on."""
        held, self._held = self._held, b""
        if NBC_LINE.search(held):
            self.dropped += 1
            return b""
        return held


def summary(dropped: int) -> str | None:
    """The launcher's line about the dropped lines, or None when there were none."""
    if not dropped:
        return None
    return (
        f"left out {dropped} line(s) of Open MPI's internal NBC errors (non-blocking collectives a lost peer cut "
        "short; the survivors repaired in place)"
    )
