"""What a pod holds on a node's cards, by its annotations and the node's ledger.

A pod's cards come from the most precise annotation it carries, on every component:

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

Pod annotations are written by the extender, but a pod's owner can rewrite them where no admission
control stops it. So what a pod holds is, first, its entry in the node's ledger (the extender's record
on the Node, which tenants can't write: :mod:`gpushare.contract.pending`); a pod whose annotations
disagree is reported (:class:`~gpushare.contract.errors.LedgerMismatch`) and counted as recorded.
A pod with no entry (bound by the original extender) is counted from its annotations, but never past
its request: each container at what it requests on each card its annotation names that the node has
(:class:`~gpushare.contract.errors.OverClaimError` when the annotation claims more).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.cards import Card
from gpushare.contract.aliyun import parse_card_index
from gpushare.contract.allocation import Allocation, CardSlice, parse_allocation
from gpushare.contract.errors import AnnotationError, ContractError, LedgerMismatch, OverClaimError, json_object, quoted
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import ANN_ALLOCATION, ANN_FRAMEWORK_ALLOCATION, ANN_MEM_IDX, NODE_ANN_PENDING_BINDS
from gpushare.contract.pending import PendingBind
from gpushare.contract.request import PodRequest, annotations_of, effective_request, parse_pod_request, pod_key
from gpushare.contract.units import UNITS_LIMIT, bounded

FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


def holds_resources(pod: Mapping[str, Any]) -> bool:
    """A pod holds its cards until it finishes or is deleted."""
    return (pod.get("status") or {}).get("phase") not in FINISHED_PHASES


def card_by_minor(cards: Iterable[Card], number: int, pod: str, where: str) -> Card:
    """The card the original components mean by ``number`` (its /dev/nvidia minor)."""
    for card in cards:
        if card.minor == number:
            return card
    raise ContractError(f"pod {pod} {where}: card {number} (a /dev/nvidia minor number) is not on this node")


def _ours(pod: Mapping[str, Any], request: PodRequest, problems: list[ContractError]) -> Allocation:
    """Our annotation as written, less the containers in it that request no GPU (each a problem); a
    card it names that this node lacks is the reader's to handle."""
    key = request.key
    allocation = parse_allocation(annotations_of(pod)[ANN_ALLOCATION], key)
    unknown = sorted(set(allocation) - {c.name for c in request.gpu_containers})
    if unknown:
        problems.append(
            AnnotationError(
                f"pod {key} annotation {ANN_ALLOCATION}: names container(s) {quoted(unknown)} that request no GPU"
            )
        )
    return {name: slices for name, slices in allocation.items() if name not in unknown}


def _framework(
    pod: Mapping[str, Any], request: PodRequest, cards: Sequence[Card], problems: list[ContractError]
) -> Allocation:
    """``{"<app container position>": {"<card minor>": units}}``; init containers have no position.
    A card this node lacks is a problem, and left out."""
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
            index = parse_card_index(number, request.key)
            if not isinstance(units, int) or isinstance(units, bool) or units <= 0:
                raise AnnotationError(
                    f"pod {request.key} {where}: units {quoted(units)} on card {number} is not a positive integer"
                )
            bounded(units, UNITS_LIMIT, f"pod {request.key} {where}: units on card {number}")
            try:
                card = card_by_minor(cards, index, request.key, where)
            except ContractError as exc:
                problems.append(exc)
                continue
            slices.append(CardSlice(index=card.index, uuid=card.uuid, units=units))
        if slices:
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


def read_allocation(
    pod: Mapping[str, Any], cards: Sequence[Card], *, inferred: bool = False
) -> tuple[Allocation | None, list[ContractError]]:
    """What can be read of the cards the scheduler gave each container on this node (None when no
    scheduler has placed the pod), and what was wrong: containers that request no GPU, and cards this
    node lacks in the original formats (numbered by minor), are left out, each a problem; cards named
    by UUID are left as written. ContractError when nothing can be read."""
    return _read_allocation(pod, parse_pod_request(pod), cards, inferred)


def _read_allocation(
    pod: Mapping[str, Any], request: PodRequest, cards: Sequence[Card], inferred: bool
) -> tuple[Allocation | None, list[ContractError]]:
    """:func:`read_allocation` of a pod whose request is read already."""
    source = allocation_source(pod, inferred=inferred)
    problems: list[ContractError] = []
    if source == ANN_ALLOCATION:
        return _ours(pod, request, problems), problems
    if source == ANN_FRAMEWORK_ALLOCATION:
        return _framework(pod, request, cards, problems), problems
    if source == ANN_MEM_IDX:
        return _original_index(pod, request, cards), problems
    return None, problems


def allocation_source(pod: Mapping[str, Any], *, inferred: bool = False) -> str | None:
    """The annotation the pod's cards are read from (see the module doc), or None."""
    ann = annotations_of(pod)
    if ANN_ALLOCATION in ann and not inferred:
        return ANN_ALLOCATION
    return next((key for key in (ANN_FRAMEWORK_ALLOCATION, ANN_MEM_IDX) if key in ann), None)


def pod_allocation(pod: Mapping[str, Any], cards: Sequence[Card], *, inferred: bool = False) -> Allocation | None:
    """The cards the scheduler gave each of the pod's containers on this node, or None when no
    scheduler has placed it; ContractError (naming pod and annotation) when its annotations can't be
    read, name containers that request no GPU or (by minor) a card the node doesn't have; a card named
    by UUID that the node lacks is the reader's to refuse. ``inferred``: the node's cards were inferred
    from its status, so only the original numbering applies. See the module doc for which annotation
    wins."""
    allocation, problems = read_allocation(pod, cards, inferred=inferred)
    if problems:
        raise problems[0]
    return allocation


def capped(
    allocation: Allocation, request: PodRequest, inventory: NodeInventory, field: str
) -> tuple[Allocation, list[ContractError]]:
    """The allocation as the pod's request allows it: every slice at what its container requests on a
    card (its gpu-mem per card, or the whole card for gpu-count alone), never at a forged amount; a
    slice claiming more is an :class:`OverClaimError` naming ``field``, the annotation read.
    ``allocation`` names only cards on the node."""
    by_uuid = {c.uuid: c for c in inventory.cards}
    result: Allocation = {}
    problems: list[ContractError] = []
    for name, slices in allocation.items():
        container = request.container(name)
        if container is None:
            continue
        kept = []
        for s in slices:
            card = by_uuid[s.uuid]
            requested = inventory.units_of(card) if container.exclusive else container.units_per_card
            if s.units > requested:
                problems.append(OverClaimError(request.key, name, f"{s.index} ({s.uuid})", field, s.units, requested))
            kept.append(CardSlice(s.index, s.uuid, requested))
        result[name] = tuple(kept)
    return result, problems


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
    """A pod whose annotations are wrong, and why (the reason names the pod). ``counted``: whether it is
    counted anyway, at what it can be known to hold (its ledger entry, else its request on the cards
    its annotation names that the node has); else nothing about its cards can be read."""

    key: str
    reason: str
    counted: bool = False


def describe_held(held: Mapping[str, int], cards: Sequence[Card]) -> str:
    """``card 0 (GPU-…) 8 unit(s), …``: how a pod's holding is named in messages."""
    index = {c.uuid: c.index for c in cards}
    return ", ".join(f"card {index.get(u, '?')} ({u}) {n} unit(s)" for u, n in sorted(held.items())) or "no card"


def pod_cards(
    pod: Mapping[str, Any],
    inventory: NodeInventory,
    recorded: PendingBind | None = None,
    request: PodRequest | ContractError | None = None,
) -> tuple[PodCards | None, list[ContractError]]:
    """What the pod holds on this node (None when unplaced or when nothing can be read of it), and
    what is wrong with its annotations. ``request``: the pod's request (or why it can't be read) when
    the caller has read it already.

    ``recorded``: the pod's entry in the node's ledger (same uid). It is what the pod holds, whatever
    its annotations say; annotations that disagree are a :class:`LedgerMismatch`. Without one (a pod
    bound by the original extender, or before the ledger), the annotations count, capped at the
    request (:func:`capped`); cards the node lacks are left out. A pod is never counted at a forged
    amount, nor at zero when any of its cards can be known."""
    key = pod_key(pod)
    uid = (pod.get("metadata") or {}).get("uid", "")
    inferred = inventory.inferred is not None
    known = {c.uuid for c in inventory.cards}
    problems: list[ContractError] = []
    claimed: dict[str, int] = {}
    try:
        if request is None:
            request = parse_pod_request(pod)
        elif isinstance(request, ContractError):
            raise request.with_traceback(None)
        allocation, problems = _read_allocation(pod, request, inventory.cards, inferred)
        source = allocation_source(pod, inferred=inferred) or ""
        if allocation and (lacking := sorted({s.uuid for ss in allocation.values() for s in ss} - known)):
            problems.append(ContractError(f"pod {key}: card(s) {', '.join(lacking)} are not on this node"))
            allocation = {n: kept for n, ss in allocation.items() if (kept := tuple(s for s in ss if s.uuid in known))}
        if allocation:
            allocation, over = capped(allocation, request, inventory, source)
            problems += over
            claimed = held_units(allocation, request)
    except ContractError as exc:
        allocation, problems = None, [exc]
    if recorded is not None:
        held = {uuid: units for uuid, units in recorded.held.items() if uuid in known}
        if claimed != dict(recorded.held):
            claim, record = (describe_held(h, inventory.cards) for h in (claimed, recorded.held))
            problems.append(LedgerMismatch(key, NODE_ANN_PENDING_BINDS, claim, record))
        return PodCards(key, uid, allocation or {}, held), problems
    if not allocation:
        return None, problems
    return PodCards(key, uid, allocation, claimed), problems
