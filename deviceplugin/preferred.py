"""GetPreferredAllocation: steer kubelet's device pick toward the scheduler's cards.

For gpu-count the device IDs are card UUIDs, so the preference is exactly the scheduler's choice;
without one, cards that share NVLink come first, then cards on one NUMA node. For gpu-mem the IDs
are per-unit, and preferring units of the assigned card keeps kubelet's own bookkeeping in line
with where the memory really goes.
"""

from __future__ import annotations

from collections.abc import Sequence

from deviceplugin.devices import card_of_mem_device
from gpushare import placement
from gpushare.cards import Card
from gpushare.contract import RESOURCE_MEM

BINPACK = placement.POLICIES["binpack"]


def _topology_order(available: Sequence[str], cards: Sequence[Card], size: int) -> list[str]:
    """Pick ``size`` free cards with the scheduler's own rule for multi-card demands (NVLink, then NUMA)."""
    free = set(available)
    pool = [
        placement.Card(c.index, c.uuid, capacity=1, used=0, numa=c.numa_node, nvlink=frozenset(c.nvlink_peers))
        for c in cards
        if c.uuid in free
    ]
    try:
        (chosen,) = placement.place(pool, [placement.Demand("preferred", 0, size, exclusive=True)], BINPACK)
    except placement.NoFit:
        return []
    return [uuid for _, uuid, _ in chosen.cards]


def preferred_ids(
    resource: str,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    chosen: Sequence[str],
    cards: Sequence[Card],
) -> list[str]:
    """``size`` device IDs from ``available`` (``must_include`` kept), as close to ``chosen`` as possible."""
    picked = list(dict.fromkeys(must_include))[:size]
    rest = [d for d in available if d not in picked]
    if resource == RESOURCE_MEM:
        rank = {uuid: i for i, uuid in enumerate(chosen)}
        rest.sort(key=lambda d: (rank.get(card_of_mem_device(d), len(rank)), d))
        return picked + rest[: size - len(picked)]
    wanted = [u for u in chosen if u in rest]
    if len(wanted) < size - len(picked):
        wanted += [u for u in _topology_order(rest, cards, size) if u not in wanted]
    return picked + wanted[: size - len(picked)]
