"""The binds this replica has in flight: placed and recorded, but not yet seen on the pod."""

from __future__ import annotations

from collections.abc import Mapping


class InFlight:
    """Per pod uid: the node and the units per card UUID it was placed with, until the pod's own
    annotations (or its end) speak for them. The cache calls it under its lock; it takes none of its own."""

    def __init__(self) -> None:
        self._binds: dict[str, tuple[str, Mapping[str, int]]] = {}

    def add(self, uid: str, node: str, held: Mapping[str, int]) -> None:
        self._binds[uid] = (node, held)

    def drop(self, uid: str) -> str | None:
        """Forget the pod's bind; the node it was on, or None when it had none in flight."""
        bind = self._binds.pop(uid, None)
        return None if bind is None else bind[0]

    def __contains__(self, uid: str) -> bool:
        return uid in self._binds

    def uids(self) -> set[str]:
        return set(self._binds)

    def on(self, node: str) -> list[tuple[str, Mapping[str, int]]]:
        """(uid, units per card UUID) of the binds onto ``node``."""
        return [(uid, held) for uid, (n, held) in self._binds.items() if n == node]
