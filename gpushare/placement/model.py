"""Plain data for placement: a node's cards as the scheduler sees them, and what a pod asks of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CardCapacity:
    """What placement sees of one card: its capacity and the units already used of it, in the plugin's
    memory unit (the inventory's description of a card is :class:`gpushare.cards.Card`)."""

    index: int
    uuid: str
    capacity: int
    used: int
    healthy: bool = True
    numa: int | None = None
    nvlink: frozenset[str] = frozenset()
    model: str = ""

    @property
    def free(self) -> int:
        """Units that can still be handed out; an unhealthy card has none."""
        return max(self.capacity - self.used, 0) if self.healthy else 0


@dataclass(frozen=True, slots=True)
class Demand:
    """One container's GPU demand.

    Shared: ``units`` on each of ``cards`` distinct cards. Exclusive: ``cards`` whole, completely free
    cards (``units`` is 0 and each card then counts as fully used).
    """

    container: str
    units: int
    cards: int = 1
    exclusive: bool = False

    def __post_init__(self) -> None:
        if self.cards < 1:
            raise ValueError(f"container {self.container}: cards must be >= 1, got {self.cards}")
        if self.exclusive and self.units:
            raise ValueError(f"container {self.container}: an exclusive demand takes whole cards, units must be 0")
        if not self.exclusive and self.units < 1:
            raise ValueError(f"container {self.container}: a shared demand needs units >= 1, got {self.units}")

    @property
    def shape(self) -> Shape:
        return Shape(self.units, self.cards, self.exclusive)


@dataclass(frozen=True, slots=True, order=True)
class Shape:
    """A demand without its container name: what fragmentation and caches are keyed on."""

    units: int
    cards: int = 1
    exclusive: bool = False

    def threshold(self, capacity: int) -> int:
        """Free units a card of ``capacity`` needs to take one of this shape's cards."""
        return capacity if self.exclusive else self.units


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where one container goes: ``(card index, card uuid, units taken)`` per card.

    An exclusive card records its whole capacity as taken.
    """

    container: str
    cards: tuple[tuple[int, str, int], ...]


class NoFit(Exception):
    """The demands can't be placed on this node; ``reason`` is the human explanation."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def shape_key(demands: tuple[Demand, ...] | list[Demand]) -> tuple[Shape, ...]:
    """Container-name-free key of a pod's demands (sorted), for memoising per-node results."""
    return tuple(sorted(d.shape for d in demands))


def models_allow(acceptable: frozenset[str], model: str) -> bool:
    """Whether a card of ``model`` suits a pod that accepts the card models ``acceptable`` (empty: any)."""
    return not acceptable or model in acceptable
