"""The order of the devices in the node's ResourceSlice, so that kube-scheduler's first fit packs. Pure.

kube-scheduler 1.37's DRA allocator gives a request the first devices, in slice order, with room for it,
and scores no device (k8s.io/dynamic-resource-allocation v0.37.2,
``structured/internal/{stable,incubating,experimental}/allocator_*.go``, which walk ``slice.Spec.Devices``
in order; k8s.io/kubernetes v1.37.2, ``pkg/scheduler/framework/plugins/dynamicresources``, whose ``Score``
ranks only ``firstAvailable`` subrequests). The slice's order is the one thing the driver has to
say which card a claim gets. Listing the cards least free first turns first fit into best fit, the
extender's ``binpack`` choice of card: a share goes to the fullest card that still holds it, and empty
cards are broken into only when no used card has room.

- used cards (full ones included, which fit nothing) come first, least free memory first;
- then the empty cards: first those whose NUMA node or NVLink clique already holds a used card, so that
  a group with every card empty stays whole for claims that want cards of one group; then the others;
- equal keys keep NVML index order, so the order changes only when what is free does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: ``gpushare node --dra-order``: devices in NVML index order, or least free first (:func:`best_fit_order`)
ORDER_INDEX, ORDER_BEST_FIT = "index", "best-fit"
DRA_ORDERS = (ORDER_INDEX, ORDER_BEST_FIT)


@dataclass(frozen=True, slots=True)
class CardRoom:
    """One card of the slice: its memory and what allocated claims consume of it, in bytes, and the
    groups (NUMA node, NVLink clique) it belongs to, None where it has none."""

    index: int
    capacity: int
    used: int = 0
    numa: int | None = None
    clique: int | None = None

    @property
    def free(self) -> int:
        return max(self.capacity - self.used, 0)


def best_fit_order(cards: Sequence[CardRoom]) -> tuple[int, ...]:
    """The cards' NVML indexes in the order first fit should meet them (see the module's docstring)."""
    used = [c for c in cards if c.used > 0]
    busy_numa = {c.numa for c in used if c.numa is not None}
    busy_clique = {c.clique for c in used if c.clique is not None}

    def key(card: CardRoom) -> tuple[int, int, int]:
        if card.used > 0:
            return (0, card.free, card.index)
        grouped = card.numa in busy_numa or card.clique in busy_clique
        return (1 if grouped else 2, 0, card.index)

    return tuple(c.index for c in sorted(cards, key=key))
