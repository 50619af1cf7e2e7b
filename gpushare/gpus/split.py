"""Which of a node's cards the DRA driver offers and which the device plugin does.

A card belongs to one way at a time. The scheduler's DRA allocator counts only ResourceClaims and the
extender counts only pods' annotations: if both offered one card, each would fill it without seeing the
other. So ``--dra-cards`` splits the node's cards once, at the node agent's start. The advertiser's
inventory, the device plugin's resources and what the extender places on list only the device
plugin's cards; the ResourceSlice and the kubelet plugin only the DRA cards.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpushare.cards import Card
from gpushare.contract.names import DRA_DRIVER
from gpushare.gpus.backend import GpuBackend, HealthCallback, HealthEvent, InventoryError

log = logging.getLogger(__name__)

#: ``--dra-cards`` naming every card of the node
ALL_CARDS = "all"


@dataclass(frozen=True, slots=True)
class DraCards:
    """``--dra-cards``: every card, or the cards named by NVML index or UUID."""

    every: bool = False
    named: frozenset[str] = frozenset()

    def owns(self, card: Card) -> bool:
        return self.every or str(card.index) in self.named or card.uuid in self.named


#: every card to the DRA driver: ``--dra`` without ``--dra-cards``
EVERY_CARD = DraCards(every=True)


def parse_dra_cards(text: str) -> DraCards:
    """``"all"`` or a comma-separated list of NVML indexes and UUIDs; anything else is refused."""
    if text.strip() == ALL_CARDS:
        return EVERY_CARD
    named = [part.strip() for part in text.split(",") if part.strip()]
    bad = [p for p in named if not (p.isdigit() or p.startswith("GPU-"))]
    if not named or bad:
        raise InventoryError(
            f"--dra-cards {text!r}: expected {ALL_CARDS!r} or card indexes / GPU- UUIDs separated by commas"
            + (f"; {', '.join(bad)} is neither" if bad else "")
        )
    return DraCards(named=frozenset(named))


def check_dra_cards(choice: DraCards, cards: Iterable[Card]) -> None:
    """Refuses a ``--dra-cards`` that names a card the node doesn't have."""
    cards = list(cards)
    known = {str(c.index) for c in cards} | {c.uuid for c in cards}
    if missing := sorted(choice.named - known):
        have = ", ".join(f"{c.index} ({c.uuid})" for c in cards) or "none"
        raise InventoryError(f"--dra-cards names {', '.join(missing)}, not a card of this node (cards: {have})")


class CardSubset:
    """The cards of ``backend`` that ``keep`` admits, behind the same interface. Health events of the
    other cards don't reach its subscribers. Closing it leaves ``backend`` open (its owner closes it)."""

    def __init__(self, backend: GpuBackend, keep: Callable[[Card], bool]) -> None:
        self._backend = backend
        self._uuids = frozenset(c.uuid for c in backend.cards() if keep(c))
        self._relays: dict[HealthCallback, HealthCallback] = {}
        self._lock = threading.Lock()

    def cards(self) -> list[Card]:
        return [c for c in self._backend.cards() if c.uuid in self._uuids]

    def set_memory_limit(self, uuid: str, cgroup: Path, soft_bytes: int, hard_bytes: int) -> None:
        if uuid not in self._uuids:
            raise InventoryError(f"card {uuid} is not one of these cards")
        self._backend.set_memory_limit(uuid, cgroup, soft_bytes, hard_bytes)

    def subscribe(self, callback: HealthCallback) -> None:
        def relay(event: HealthEvent) -> None:
            if event.uuid in self._uuids:
                callback(event)

        with self._lock:
            self._relays[callback] = relay
        self._backend.subscribe(relay)

    def unsubscribe(self, callback: HealthCallback) -> None:
        with self._lock:
            relay = self._relays.pop(callback, None)
        if relay is not None:
            self._backend.unsubscribe(relay)

    def close(self) -> None:
        with self._lock:
            relays = list(self._relays.values())
            self._relays.clear()
        for relay in relays:
            self._backend.unsubscribe(relay)


def split_cards(backend: GpuBackend, choice: DraCards) -> tuple[CardSubset, CardSubset]:
    """(the device plugin's cards, the DRA driver's cards) of ``backend``."""
    cards = backend.cards()
    check_dra_cards(choice, cards)
    for way, owned in ((f"DRA (driver {DRA_DRIVER})", True), ("the device plugin", False)):
        picked = ", ".join(f"{c.index} ({c.uuid})" for c in cards if choice.owns(c) == owned) or "none"
        log.info("cards offered through %s: %s", way, picked)
    return CardSubset(backend, lambda c: not choice.owns(c)), CardSubset(backend, choice.owns)
