"""An orphan's lobby: the shrunk communicator a broken replica's live ranks keep with the survivors (salvage).

The communicator makes one per repair that orphans ranks and raises :class:`Orphaned` in each
orphan; the seat protocol over it is :mod:`lightning_recover.comm.orphans`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Lobby", "Orphaned"]


@dataclass
class Lobby:
    """The shrunk communicator of one repair, kept by its survivors and its orphans.

    ``orphans``: the logical ranks that were orphaned there and still wait; ``logical``: the
    logical rank of each of the lobby's ranks (to address an orphan on it)."""

    comm: Any
    orphans: list[int]
    logical: tuple[int, ...]
    world_epoch: int

    def lobby_rank(self, logical_rank: int) -> int:
        return self.logical.index(logical_rank)


class Orphaned(BaseException):
    """This rank's replica lost a mate and salvage is on: the rank leaves the world but stays, on ``lobby``.

    A ``BaseException`` so that a user's ``except Exception`` around training does not swallow it."""

    def __init__(self, lobby: Lobby, lost: Sequence[int], reason: str) -> None:
        self.lobby = lobby
        self.lost = tuple(lost)
        super().__init__(reason)


