"""Where a replacement goes: the placement rule of hot re-join, pure (no MPI).

A lost replica's replacement (a cold spawn or a warm standby) is placed by Open MPI's
``host`` spawn key, which this module computes:

1. ``recover.rejoin.hosts`` when the user set it: their hosts, as given.
2. Else the hosts the launcher found free slots on (``lightning-recover launch`` exports them
   in :data:`~lightning_recover.runtime.markers.ENV_SPARE_HOSTS`): **spare hosts first** (hosts
   of the launch that run none of its ranks, so a replacement never lands beside the ranks
   of a host that is failing), **then hosts with free slots**, each in the launch's order.
   A failed attempt starts the list at the next host, so a spare host that was lost (its
   spawn never comes up) costs one attempt, not all of them.
3. Else (one machine, or every slot used): oversubscribe the launch's hosts, where Open MPI
   puts the process on the first host (the head), as before.

A dead rank's slot is never given back by Open MPI, so rule 2 and 3 always allow
oversubscription too: a replacement that finds its spare host's slots taken by an earlier
replacement still starts there rather than failing.
"""

from __future__ import annotations

__all__ = ["SpawnPlacement", "spawn_placement"]

from dataclasses import dataclass


@dataclass(frozen=True)
class SpawnPlacement:
    """Open MPI's spawn info for one attempt: ``host`` (None: any of the launch's hosts) and oversubscription."""

    host: str | None
    oversubscribe: bool

    def describe(self) -> str:
        return f"on {self.host}" if self.host else "on the launch's hosts (oversubscribed)"

    def info_items(self, wdir: str) -> list[tuple[str, str]]:
        """The MPI_Info keys of a spawn placed so, started in ``wdir``."""
        items = [("wdir", wdir), ("bind_to", "none")]
        if self.host:
            items.append(("host", self.host))
        if self.oversubscribe:
            # A dead rank's slot is not given back: only an oversubscribed placement finds room.
            items.append(("map_by", ":OVERSUBSCRIBE"))
        return items


def _rotate(hosts: str, by: int) -> str:
    names = [h for h in hosts.split(",") if h.strip()]
    if not names:
        return ""
    k = by % len(names)
    return ",".join(names[k:] + names[:k])


def spawn_placement(configured: str | None, spare: str | None, failed_attempts: int) -> SpawnPlacement:
    """The placement of the next spawn (module docstring): ``configured`` is ``recover.rejoin.hosts``,
    ``spare`` the launcher's free hosts (``ENV_SPARE_HOSTS``, ``name:free,...``, spare hosts first),
    ``failed_attempts`` how many attempts in a row failed (each moves the start of the list by one)."""
    if failed_attempts < 0:
        raise ValueError(f"failed_attempts must be >= 0, got {failed_attempts}")
    if configured:
        return SpawnPlacement(configured, oversubscribe=False)
    if spare and (hosts := _rotate(spare, failed_attempts)):
        return SpawnPlacement(hosts, oversubscribe=True)
    return SpawnPlacement(None, oversubscribe=True)
