"""GetPreferredAllocation: steer kubelet's device pick toward the scheduler's cards.

For gpu-count the device IDs are card UUIDs, so the preference is exactly the scheduler's choice;
without one, cards that share NVLink come first, then cards on one NUMA node. For gpu-mem the IDs
are per-unit, and preferring units of the assigned card keeps kubelet's own bookkeeping in line
with where the memory really goes.
"""

from __future__ import annotations

from collections.abc import Sequence

from deviceplugin.devices import card_of_mem_device
from gpushare.cards import Card
from gpushare.contract import RESOURCE_MEM


def _topology_order(available: Sequence[str], cards: Sequence[Card], size: int) -> list[str]:
    """Pick ``size`` cards: the largest NVLink-connected group first, then the fullest NUMA node."""
    by_uuid = {c.uuid: c for c in cards}
    pool = sorted((u for u in available if u in by_uuid), key=lambda u: by_uuid[u].index)
    best: list[str] = []
    for seed in pool:
        group = [seed] + [u for u in pool if u != seed and u in by_uuid[seed].nvlink_peers]
        numa = by_uuid[seed].numa_node
        group += [u for u in pool if u not in group and by_uuid[u].numa_node == numa]
        group += [u for u in pool if u not in group]
        if not best or _score(group[:size], by_uuid) > _score(best[:size], by_uuid):
            best = group
    return best[:size]


def _score(group: list[str], by_uuid: dict[str, Card]) -> tuple[int, int]:
    links = sum(1 for a in group for b in group if b in by_uuid[a].nvlink_peers)
    same_numa = sum(1 for a in group for b in group if by_uuid[a].numa_node == by_uuid[b].numa_node)
    return links, same_numa


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
