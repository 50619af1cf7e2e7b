"""GetPreferredAllocation: steer kubelet's device pick toward the scheduler's cards.

Every device ID names its card. For gpu-count the preference is one replica of each of the
scheduler's cards, so the replicas kubelet books are on distinct cards, the very ones the container
gets; without a choice, cards that share NVLink come first, then cards on one NUMA node. For
gpu-mem, preferring units of the assigned card keeps kubelet's own bookkeeping in line with where
the memory really goes.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.deviceplugin.devices import card_of_device

from gpushare import placement
from gpushare.cards import Card
from gpushare.contract.names import RESOURCE_MEM

BINPACK = placement.POLICIES["binpack"]


def _unknown(uuid: str) -> placement.CardCapacity:
    """A card the node's inventory doesn't list: no model, and memory limits not reported."""
    return placement.CardCapacity(-1, uuid, 0, 0)


def _topology_order(
    available: Sequence[str], cards: Sequence[Card], size: int, rule: placement.CardRule, joined: Sequence[str]
) -> list[str]:
    """Pick ``size`` free cards with the scheduler's own rule for multi-card demands (NVLink, then NUMA),
    within what the pod's ``rule`` allows beside the cards ``joined`` already offered; [] when none do."""
    free = set(available)
    pool = [
        placement.CardCapacity.of(c, 1, 0 if c.uuid in free else 1) for c in cards if c.uuid in free or c.uuid in joined
    ]
    demand = placement.Demand("preferred", 0, size, exclusive=True)
    try:
        (chosen,) = placement.place(pool, [demand], BINPACK, rule=rule, joined=joined)
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
    rule: placement.CardRule = placement.ANY_CARD,
) -> list[str]:
    """``size`` device IDs from ``available`` (``must_include`` kept), as close to ``chosen`` as possible.

    Where the plugin picks cards itself, ``rule`` (the matched pod's card rule) is kept: no card it
    doesn't admit (a refused model, no memory limits where required), and with NVLink or one NUMA node
    required no set that breaks it. Then it may offer fewer than ``size`` IDs, and kubelet completes the
    set on its own.
    """
    picked = list(dict.fromkeys(must_include))[:size]
    rest = [d for d in available if d not in picked]
    if rule.picks_cards:
        known = {c.uuid: placement.CardCapacity.of(c) for c in cards}
        rest = [d for d in rest if rule.admits(known.get(card_of_device(d)) or _unknown(card_of_device(d)))]
    if resource == RESOURCE_MEM:
        rank = {uuid: i for i, uuid in enumerate(chosen)}
        rest.sort(key=lambda d: (rank.get(card_of_device(d), len(rank)), d))
        return picked + rest[: size - len(picked)]
    taken = {card_of_device(d) for d in picked}
    replica: dict[str, str] = {}  # card -> the replica to offer for it
    for d in sorted(rest):
        if card_of_device(d) not in taken:
            replica.setdefault(card_of_device(d), d)
    need = size - len(picked)
    wanted = [u for u in chosen if u in replica][:need]
    if len(wanted) < need:
        others = [u for u in replica if u not in wanted]
        wanted += _topology_order(others, cards, need - len(wanted), rule, [*taken, *wanted])
    ids = picked + [replica[u] for u in wanted]
    # fewer distinct free cards than asked (kubelet's books disagree with ours): any replicas will do,
    # but under a topology rule only more replicas of the cards offered
    offered = {card_of_device(d) for d in ids}
    fill = [d for d in rest if d not in ids and (not rule.topology or card_of_device(d) in offered)]
    return ids + fill[: size - len(ids)]
