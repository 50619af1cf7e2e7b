"""How much of each card the pods on a node hold, computed from their annotations.

The device plugin, the CRI shim, the extender cache and ``inspect`` all need the same answer, so it
is computed here, once, from plain pod dicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.cards import Card
from gpushare.contract import (
    Allocation,
    CardSlice,
    ContractError,
    MemoryUnit,
    parse_pod_request,
    pod_allocation,
    pod_key,
)

FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


def holds_resources(pod: Mapping[str, Any]) -> bool:
    """A pod holds its cards until it finishes or is deleted."""
    return (pod.get("status") or {}).get("phase") not in FINISHED_PHASES


@dataclass(frozen=True, slots=True)
class PodCards:
    """One pod's resolved allocation (UUIDs filled in from the node's cards)."""

    key: str
    uid: str
    allocation: Allocation


@dataclass(frozen=True, slots=True)
class BadPod:
    key: str
    reason: str


def resolve_allocation(pod: Mapping[str, Any], cards: Iterable[Card]) -> Allocation | None:
    """The pod's allocation with every card named by UUID; raises ContractError on bad annotations.

    Pods written by the original extender carry only a card index; it is translated through the
    node's inventory, and an index the node doesn't have is an error.
    """
    by_index = {c.index: c.uuid for c in cards}
    request = parse_pod_request(pod)
    allocation = pod_allocation(pod, request, by_index)
    if allocation is None:
        return None
    for container, slices in allocation.items():
        for s in slices:
            if not s.uuid:
                raise ContractError(
                    f"pod {request.key} container {container}: card index {s.index} is not on this node"
                )
    return allocation


def node_usage(
    pods: Iterable[Mapping[str, Any]], cards: Iterable[Card], *, exclude_uid: str | None = None
) -> tuple[dict[str, int], list[PodCards], list[BadPod]]:
    """Units held per card UUID by the live pods, the pods counted, and the pods whose annotations
    could not be read (they are reported, never silently counted as zero-cost)."""
    cards = list(cards)
    used = {c.uuid: 0 for c in cards}
    counted: list[PodCards] = []
    bad: list[BadPod] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not holds_resources(pod) or (exclude_uid and meta.get("uid") == exclude_uid):
            continue
        try:
            allocation = resolve_allocation(pod, cards)
        except ContractError as exc:
            bad.append(BadPod(pod_key(pod), str(exc)))
            continue
        if not allocation:
            continue
        counted.append(PodCards(pod_key(pod), meta.get("uid", ""), allocation))
        for slices in allocation.values():
            for s in slices:
                used[s.uuid] = used.get(s.uuid, 0) + s.units
    return used, counted, bad


def card_capacity(card: Card, unit: MemoryUnit) -> int:
    return unit.units_of(card.memory_mib)


def overcommitted(
    slices: Iterable[CardSlice], used: Mapping[str, int], cards: Mapping[str, Card], unit: MemoryUnit
) -> str | None:
    """Why adding ``slices`` on top of ``used`` would not fit, or None when it fits."""
    extra: dict[str, int] = {}
    for s in slices:
        extra[s.uuid] = extra.get(s.uuid, 0) + s.units
    for uuid, units in sorted(extra.items()):
        card = cards.get(uuid)
        if card is None:
            return f"card {uuid} is not on this node"
        capacity = card_capacity(card, unit)
        if used.get(uuid, 0) + units > capacity:
            return (
                f"card {card.index} ({uuid}) would be over-committed: {used.get(uuid, 0)} + {units} > "
                f"{capacity} {unit.name} unit(s)"
            )
    return None
