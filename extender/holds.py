"""The gang holds the nodes' ledgers carry (entries that name a gang; :mod:`gpushare.extender.reservations`
writes them): which nodes hold cards for which member, which holds count, and when the first of them on
a node expires."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpushare.contract.pending import Ledger, PendingBind


class NodeHolds:
    """The gang holds of every node. The cache calls it under its lock; it takes none of its own."""

    def __init__(self) -> None:
        self._holds: dict[str, dict[str, PendingBind]] = {}
        #: member uid -> the nodes holding cards for it
        self._nodes_of: dict[str, set[str]] = {}
        #: node -> when the first hold it counts expires
        self._expiry: dict[str, float] = {}

    def note(self, node: str, ledger: Ledger) -> None:
        """Keep the gang holds among the node's ledger entries."""
        for uid in self._holds.pop(node, {}):
            nodes = self._nodes_of.get(uid, set())
            nodes.discard(node)
            if not nodes:
                self._nodes_of.pop(uid, None)
        holds = {uid: entry for uid, entry in ledger.items() if entry.gang}
        if holds:
            self._holds[node] = holds
        for uid in holds:
            self._nodes_of.setdefault(uid, set()).add(node)

    def nodes_of(self, uid: str) -> Iterable[str]:
        """The nodes holding cards for the member ``uid``."""
        return tuple(self._nodes_of.get(uid, ()))

    def nodes(self) -> list[str]:
        return sorted(self._holds)

    def counted(self, node: str, now: float, waiting: Callable[[str, PendingBind], bool]) -> dict[str, PendingBind]:
        """The node's holds that count: unexpired, for a member ``waiting`` says still waits for its bind."""
        return {
            uid: entry
            for uid, entry in self._holds.get(node, {}).items()
            if waiting(uid, entry) and now < entry.expires()
        }

    def expire_at(self, node: str, counted: Iterable[PendingBind]) -> None:
        """Remember when the first of the node's ``counted`` holds expires (nothing when there are none)."""
        times = [entry.expires() for entry in counted]
        if times:
            self._expiry[node] = min(times)

    def expired(self, now: float) -> list[str]:
        """The nodes whose first counted hold has expired by ``now``; each is reported once."""
        nodes = [n for n, at in self._expiry.items() if at <= now]
        for node in nodes:
            del self._expiry[node]
        return nodes
