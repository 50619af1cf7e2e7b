"""What a node's cards are and what each pod on it holds: the one rule every component uses.

The extender, the device plugin, the CRI shim and ``inspect`` all answer "how much of each card is
taken" from here, from plain node and pod dicts, so they can't disagree.

Cards: from the advertiser's inventory annotation; on a node without it (one that still runs the
original device plugin) from ``status.allocatable`` (else ``status.capacity``), as ``gpu-count``
equal cards sharing ``gpu-mem``, the way the original extender and inspect see it.

Pods: a pod's cards come from the most precise annotation it carries, on every component:

1. ours (``gpushare.io/allocation``: container -> cards by UUID), when the node's cards are known by
   UUID;
2. the newer original extender's ``scheduler.framework.gpushare.allocation`` (app container position
   -> card number -> units);
3. the original ``ALIYUN_COM_GPU_MEM_IDX``: every gpu-mem container on that one card.

The original components number cards by their ``/dev/nvidia<minor>`` (the original device plugin
looks ``ALIYUN_COM_GPU_MEM_IDX`` up among the minors), so 2 and 3 are read by minor, never by NVML
index. A card's hold by one pod follows Kubernetes' rule for init containers: they run one at a time
before the app containers, so the pod holds the larger of its app containers' sum and its largest
init container, on each card.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.cards import Card
from gpushare.contract.aliyun import parse_card_index
from gpushare.contract.allocation import Allocation, CardSlice, parse_allocation
from gpushare.contract.errors import AnnotationError, ContractError, json_object, quoted
from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_FRAMEWORK_ALLOCATION,
    ANN_MEM_IDX,
    NODE_ANN_INVENTORY,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.request import PodRequest, annotations_of, effective_request, parse_pod_request, pod_key
from gpushare.contract.units import GIB, MemoryUnit

FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
MIB = MemoryUnit(1)
#: the original inspect's rule: a card with more units than this counts in MiB, else in GiB
MIB_THRESHOLD = 100


def holds_resources(pod: Mapping[str, Any]) -> bool:
    """A pod holds its cards until it finishes or is deleted."""
    return (pod.get("status") or {}).get("phase") not in FINISHED_PHASES


# --- a node's cards -----------------------------------------------------------------------------------


def _status_amounts(node: Mapping[str, Any]) -> tuple[int, int, str]:
    """(gpu-mem, gpu-count, where from) from status.allocatable, else status.capacity."""
    status = node.get("status") or {}
    for field in ("allocatable", "capacity"):
        values = status.get(field) or {}
        if RESOURCE_MEM in values:
            try:
                return int(str(values[RESOURCE_MEM])), int(str(values.get(RESOURCE_COUNT, 0))), f"status.{field}"
            except ValueError:
                raise ContractError(
                    f"node {(node.get('metadata') or {}).get('name', '?')} status.{field}: {RESOURCE_MEM} or "
                    f"{RESOURCE_COUNT} is not a whole number"
                ) from None
    return 0, 0, "status"


def inferred_inventory(node: Mapping[str, Any]) -> NodeInventory:
    """Equal cards from the node's advertised gpu-mem and gpu-count, as the original components see
    a node: ``gpu-count`` cards of ``gpu-mem / gpu-count`` units, numbered 0.. as their minors.

    Our device plugin advertises gpu-count replicas (by default one per unit), so a node whose
    gpu-count reaches its gpu-mem runs our plugin without its inventory annotation: it is refused
    rather than taken for that many one-unit cards.
    """
    name = (node.get("metadata") or {}).get("name", "?")
    mem, count, source = _status_amounts(node)
    missing = f"node {name} has no {NODE_ANN_INVENTORY} annotation"
    if mem <= 0:
        raise ContractError(f"{missing} and advertises no {RESOURCE_MEM} (is a gpushare device plugin running?)")
    if count <= 0:
        raise ContractError(f"{missing} and advertises {RESOURCE_MEM}={mem} but no {RESOURCE_COUNT} cards")
    if count >= mem > 1:
        raise ContractError(
            f"{missing}; its {RESOURCE_COUNT}={count} >= {RESOURCE_MEM}={mem} counts replicas, not cards "
            f"(is the advertiser running?)"
        )
    per_card = mem // count
    unit = MIB if per_card > MIB_THRESHOLD else GIB
    cards = tuple(
        Card(index=i, uuid=f"{name}/gpu{i}", model="", memory_mib=per_card * unit.mib, minor=i) for i in range(count)
    )
    note = (
        f"no {NODE_ANN_INVENTORY} annotation: {count} equal card(s) of {per_card} {unit.name} inferred from "
        f"{source} ({RESOURCE_MEM}={mem}, {RESOURCE_COUNT}={count})"
    )
    return NodeInventory(unit=unit, cards=cards, inferred=note)


def node_inventory(node: Mapping[str, Any]) -> NodeInventory:
    """The node's cards: its inventory annotation, else inferred from its status; ContractError
    (naming the node and field) when neither gives any."""
    name = (node.get("metadata") or {}).get("name", "?")
    text = annotations_of(node).get(NODE_ANN_INVENTORY)
    if text is not None:
        return parse_inventory(text, name)
    return inferred_inventory(node)


def alibaba_total_per_card(inventory: NodeInventory) -> int:
    """What the original extender and inspect take one card to hold: the node's total / its cards."""
    if not inventory.cards:
        return 0
    return sum(inventory.units_of(c) for c in inventory.cards) // len(inventory.cards)


# --- what a pod holds ---------------------------------------------------------------------------------


def card_by_minor(cards: Iterable[Card], number: int, pod: str, where: str) -> Card:
    """The card the original components mean by ``number`` (its /dev/nvidia minor)."""
    for card in cards:
        if card.minor == number:
            return card
    raise ContractError(f"pod {pod} {where}: card {number} (a /dev/nvidia minor number) is not on this node")


def _ours(pod: Mapping[str, Any], request: PodRequest) -> Allocation:
    """Our annotation as written; a card it names that this node lacks is the reader's to refuse."""
    key = request.key
    allocation = parse_allocation(annotations_of(pod)[ANN_ALLOCATION], key)
    unknown = sorted(set(allocation) - {c.name for c in request.gpu_containers})
    if unknown:
        raise AnnotationError(
            f"pod {key} annotation {ANN_ALLOCATION}: names container(s) {quoted(unknown)} that request no GPU"
        )
    return allocation


def _framework(pod: Mapping[str, Any], request: PodRequest, cards: Sequence[Card]) -> Allocation:
    """``{"<app container position>": {"<card minor>": units}}``; init containers have no position."""
    where = f"annotation {ANN_FRAMEWORK_ALLOCATION}"
    raw = json_object(
        annotations_of(pod)[ANN_FRAMEWORK_ALLOCATION], f"pod {request.key} {where}", "app container -> {card: units}"
    )
    apps = [c for c in request.containers if not c.init]
    result: Allocation = {}
    for position, numbers in raw.items():
        if not str(position).isdigit() or int(position) >= len(apps):
            raise AnnotationError(f"pod {request.key} {where}: {quoted(position)} is not an app container's position")
        if not isinstance(numbers, dict) or not numbers:
            raise AnnotationError(f"pod {request.key} {where}: container {position} has no card map")
        slices = []
        for number, units in numbers.items():
            card = card_by_minor(cards, parse_card_index(number, request.key), request.key, where)
            if not isinstance(units, int) or isinstance(units, bool) or units <= 0:
                raise AnnotationError(
                    f"pod {request.key} {where}: units {quoted(units)} on card {number} is not a positive integer"
                )
            slices.append(CardSlice(index=card.index, uuid=card.uuid, units=units))
        result[apps[int(position)].name] = tuple(sorted(slices))
    return result


def _original_index(pod: Mapping[str, Any], request: PodRequest, cards: Sequence[Card]) -> Allocation:
    number = parse_card_index(annotations_of(pod)[ANN_MEM_IDX], request.key)
    card = card_by_minor(cards, number, request.key, f"annotation {ANN_MEM_IDX}")
    return {
        c.name: (CardSlice(index=card.index, uuid=card.uuid, units=c.mem),)
        for c in request.gpu_containers
        if c.mem and not c.count
    }


def pod_allocation(pod: Mapping[str, Any], cards: Sequence[Card], *, inferred: bool = False) -> Allocation | None:
    """The cards the scheduler gave each of the pod's containers on this node, or None when no
    scheduler has placed it; ContractError (naming pod and annotation) when its annotations can't be
    read or name cards the node doesn't have. ``inferred``: the node's cards were inferred from its
    status, so only the original numbering applies. See the module doc for which annotation wins."""
    request = parse_pod_request(pod)
    ann = annotations_of(pod)
    if ANN_ALLOCATION in ann and not inferred:
        return _ours(pod, request)
    if ANN_FRAMEWORK_ALLOCATION in ann:
        return _framework(pod, request, cards)
    if ANN_MEM_IDX in ann:
        return _original_index(pod, request, cards)
    return None


def held_units(allocation: Allocation, request: PodRequest) -> dict[str, int]:
    """Units the pod holds per card UUID: per card, the larger of its app containers' sum and its
    largest init container."""
    init = {c.name for c in request.containers if c.init}
    per_card: dict[str, tuple[list[int], list[int]]] = {}
    for name, slices in allocation.items():
        for s in slices:
            apps, inits = per_card.setdefault(s.uuid, ([], []))
            (inits if name in init else apps).append(s.units)
    return {uuid: effective_request(apps, inits) for uuid, (apps, inits) in per_card.items()}


@dataclass(frozen=True, slots=True)
class PodCards:
    """One pod's resolved allocation, and what it holds on each card."""

    key: str
    uid: str
    allocation: Allocation
    #: units per card UUID, by Kubernetes' rule for init containers (see :func:`held_units`)
    held: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class BadPod:
    """A pod whose cards on this node can't be told, and why (the reason names the pod)."""

    key: str
    reason: str


def pod_cards(pod: Mapping[str, Any], cards: Sequence[Card], *, inferred: bool = False) -> PodCards | None:
    """The pod's allocation and hold on this node (None when unplaced); ContractError when its
    annotations can't be read or name a card this node doesn't have (as with the original formats,
    such a pod is counted on none of its cards)."""
    allocation = pod_allocation(pod, cards, inferred=inferred)
    if not allocation:
        return None
    key = pod_key(pod)
    held = held_units(allocation, parse_pod_request(pod))
    unknown = sorted(set(held) - {c.uuid for c in cards})
    if unknown:
        raise ContractError(f"pod {key}: card(s) {', '.join(unknown)} are not on this node")
    return PodCards(key, (pod.get("metadata") or {}).get("uid", ""), allocation, held)


def node_usage(
    pods: Iterable[Mapping[str, Any]],
    cards: Sequence[Card],
    *,
    exclude_uid: str | None = None,
    inferred: bool = False,
) -> tuple[dict[str, int], list[PodCards], list[BadPod]]:
    """Units held per card UUID by the live pods, the pods counted, and the pods whose annotations
    could not be read (they are reported, never silently counted as zero-cost).

    The one place that sums what pods hold on a node's cards: the extender, the device plugin, the
    CRI shim and ``inspect`` all take their per-card totals and per-pod holdings from here."""
    cards = tuple(cards)
    used = {c.uuid: 0 for c in cards}
    counted: list[PodCards] = []
    bad: list[BadPod] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not holds_resources(pod) or (exclude_uid and meta.get("uid") == exclude_uid):
            continue
        try:
            held = pod_cards(pod, cards, inferred=inferred)
        except ContractError as exc:
            bad.append(BadPod(pod_key(pod), str(exc)))
            continue
        if held is None:
            continue
        counted.append(held)
        for uuid, units in held.held.items():
            used[uuid] += units
    return used, counted, bad
