"""What the node agent asks of a source of cards, whichever it is (:mod:`gpushare.gpus.nvml` on a real node,
:mod:`gpushare.gpus.simulated` everywhere else).

Every backend exposes the same small interface: ``cards()`` for the current list (health included)
and ``subscribe()`` for health changes. Health changes come from XID events; which XIDs count as a
fault is decided by :func:`is_critical_xid` so that every backend agrees.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpushare.cards import Card

log = logging.getLogger(__name__)

#: XIDs that are the application's fault, not the card's (the same set NVIDIA's own plugin ignores).
DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
#: seconds a failed NVML card must stay quiet before it is trusted again (``--nvml-recovery-seconds``)
DEFAULT_NVML_RECOVERY = 300.0


class InventoryError(RuntimeError):
    """The card inventory can't be read. The message is one sentence meant for the operator."""


@dataclass(frozen=True, slots=True)
class HealthEvent:
    uuid: str
    healthy: bool
    reason: str


HealthCallback = Callable[[HealthEvent], None]


class GpuBackend(Protocol):
    def cards(self) -> list[Card]: ...

    def set_memory_limit(self, uuid: str, cgroup: Path, soft_bytes: int, hard_bytes: int) -> None:
        """Cap what processes in ``cgroup`` (a cgroup v2 directory) may allocate on the card; raises
        :class:`~gpushare.memlimits.enforcer.MemoryLimitError` with the driver's answer. Only for cards whose
        :attr:`~gpushare.cards.Card.memory_limits` is enforced."""
        ...

    def subscribe(self, callback: HealthCallback) -> None: ...

    def unsubscribe(self, callback: HealthCallback) -> None: ...

    def close(self) -> None: ...


def is_critical_xid(xid: int, ignored: frozenset[int]) -> bool:
    return xid not in ignored


def parse_ignored_xids(text: str) -> frozenset[int]:
    """``"13,31,43"`` -> the set; an empty string ignores nothing."""
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InventoryError(f"--ignore-xids {text!r} is not a comma-separated list of integers") from None


class _Subscribers:
    def __init__(self) -> None:
        self._callbacks: list[HealthCallback] = []
        self._lock = threading.Lock()

    def add(self, callback: HealthCallback) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def remove(self, callback: HealthCallback) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def emit(self, event: HealthEvent) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(event)
            except Exception:
                log.exception("health subscriber failed on card %s", event.uuid)


class CardBook:
    """The cards and their health, the base of every backend; health changes go to the subscribers."""

    def __init__(self, cards: Iterable[Card]) -> None:
        self._cards = {c.uuid: c for c in cards}
        self._subscribers = _Subscribers()
        self._lock = threading.Lock()

    def cards(self) -> list[Card]:
        with self._lock:
            return sorted(self._cards.values(), key=lambda c: c.index)

    def subscribe(self, callback: HealthCallback) -> None:
        self._subscribers.add(callback)

    def unsubscribe(self, callback: HealthCallback) -> None:
        """A stopped component hears of no more changes (a restarted one subscribes afresh)."""
        self._subscribers.remove(callback)

    def _set(self, uuid: str, healthy: bool, reason: str) -> bool:
        """Record a card's health; returns whether it changed (subscribers hear only of changes)."""
        with self._lock:
            card = self._cards.get(uuid)
            if card is None:
                raise InventoryError(f"card {uuid} is not on this node")
            if card.healthy == healthy:
                return False
            self._cards[uuid] = card.with_health(healthy)
        log.warning("card %s (index %d) is now %s: %s", uuid, card.index, _word(healthy), reason)
        self._subscribers.emit(HealthEvent(uuid, healthy, reason))
        return True


def _word(healthy: bool) -> str:
    return "Healthy" if healthy else "Unhealthy"
