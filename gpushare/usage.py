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

Pod annotations are written by the extender, but a pod's owner can rewrite them where no admission
control stops it. So what a pod holds is, first, its entry in the node's ledger (the extender's record
on the Node, which tenants can't write: :mod:`gpushare.contract.pending`); a pod whose annotations
disagree is reported (:class:`~gpushare.contract.errors.LedgerMismatch`) and counted as recorded.
A pod with no entry (bound by the original extender) is counted from its annotations, but never past
its request: each container at what it requests on each card its annotation names that the node has
(:class:`~gpushare.contract.errors.OverClaimError` when the annotation claims more).

A pod can also hold cards through ResourceClaims of the DRA driver ``gpu.gpushare.io``
(:func:`dra_held`): on each card, the sum over its claims of what they were allocated there
(``consumedCapacity.memory``, in the node's memory unit). Tenants can't forge those: the scheduler
writes a claim's allocation and reservation, so they are read from the claims, never from the pod.
A claim serves one pod at a time (:func:`_pod_claim` says why), and a container using claims sees all
their cards (:func:`dra_env`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpushare.cards import Card
from gpushare.contract.aliyun import parse_card_index
from gpushare.contract.allocation import Allocation, CardSlice, parse_allocation
from gpushare.contract.dra import parse_claim_cdi_device
from gpushare.contract.env import assigned_env
from gpushare.contract.errors import AnnotationError, ContractError, LedgerMismatch, OverClaimError, json_object, quoted
from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.kubeletwatch import parse_watching
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_FRAMEWORK_ALLOCATION,
    ANN_MEM_IDX,
    NODE_ANN_BIND_SEQUENCE,
    NODE_ANN_INVENTORY,
    NODE_ANN_KUBELET_WATCHING,
    NODE_ANN_PENDING_BINDS,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.pending import Ledger, LedgerError, PendingBind, parse_pending_binds
from gpushare.contract.request import PodRequest, annotations_of, effective_request, parse_pod_request, pod_key
from gpushare.contract.resourceclaim import ClaimAllocation, ClaimError, ClaimRef, card_slices, node_shares
from gpushare.contract.units import CARDS_LIMIT, GIB, UNITS_LIMIT, MemoryUnit, bounded

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
            where = f"node {(node.get('metadata') or {}).get('name', '?')} status.{field}"
            try:
                mem, count = int(str(values[RESOURCE_MEM])), int(str(values.get(RESOURCE_COUNT, 0)))
            except ValueError:
                raise ContractError(f"{where}: {RESOURCE_MEM} or {RESOURCE_COUNT} is not a whole number") from None
            mem = bounded(mem, UNITS_LIMIT, f"{where}.{RESOURCE_MEM}", low=-UNITS_LIMIT)
            count = bounded(count, CARDS_LIMIT, f"{where}.{RESOURCE_COUNT}", low=-CARDS_LIMIT)
            return mem, count, f"status.{field}"
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


def kubelet_refusal(node: Mapping[str, Any]) -> str | None:
    """Why no GPU pod may be placed on ``node`` for now because no kubelet is watching its device plugin
    (kubelet restarting), else None; AnnotationError when the node agent's annotation is malformed."""
    name = (node.get("metadata") or {}).get("name", "?")
    if parse_watching(annotations_of(node).get(NODE_ANN_KUBELET_WATCHING), name):
        return None
    return (
        f"node {name}: no kubelet is watching its gpushare device plugin (kubelet restarting?); "
        "GPU pods wait until one is"
    )


def node_ledger(node: Mapping[str, Any]) -> dict[str, PendingBind]:
    """The node's ledger (pod uid -> entry); LedgerError (naming the node and annotation) when it can't be
    read, or is missing though the node's bind sequence shows the extender has bound pods there: a ledger
    that was damaged never reads as empty, since pods would then count by annotations their owners can
    rewrite."""
    annotations = annotations_of(node)
    name = (node.get("metadata") or {}).get("name", "?")
    text = annotations.get(NODE_ANN_PENDING_BINDS)
    if text is None and NODE_ANN_BIND_SEQUENCE in annotations:
        raise LedgerError(
            f"node {name} annotation {NODE_ANN_PENDING_BINDS} is missing, though {NODE_ANN_BIND_SEQUENCE}="
            f"{quoted(annotations[NODE_ANN_BIND_SEQUENCE])} shows the extender has bound pods there"
        )
    return parse_pending_binds(text, name)


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


def node_usage(
    pods: Iterable[Mapping[str, Any]],
    inventory: NodeInventory,
    *,
    ledger: Ledger | None = None,
    exclude_uid: str | None = None,
    requests: Mapping[str, PodRequest | ContractError] | None = None,
) -> tuple[dict[str, int], list[PodCards], list[BadPod]]:
    """Units held per card UUID by the live pods, the pods counted, and the pods whose annotations are
    wrong (reported, and counted at what can be known, never silently as zero-cost).

    ``ledger``: the node's ledger (pod uid -> entry); an entry counts for the pod with its uid.
    ``requests``: pods' requests (or why they can't be read) by pod key, as the caller read them
    already; the others' are read here.

    The one place that sums what pods hold on a node's cards: the extender, the device plugin, the
    CRI shim and ``inspect`` all take their per-card totals and per-pod holdings from here."""
    ledger = ledger or {}
    used = {c.uuid: 0 for c in inventory.cards}
    counted: list[PodCards] = []
    bad: list[BadPod] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not holds_resources(pod) or (exclude_uid and meta.get("uid") == exclude_uid):
            continue
        request = requests.get(pod_key(pod)) if requests else None
        held, problems = pod_cards(pod, inventory, ledger.get(meta.get("uid", "")), request)
        if problems:
            bad.append(BadPod(pod_key(pod), "; ".join(str(p) for p in problems), counted=held is not None))
        if held is None:
            continue
        counted.append(held)
        for uuid, units in held.held.items():
            used[uuid] += units
    return used, counted, bad


# --- what a pod holds through DRA ---------------------------------------------------------------------


def _claim_name(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ClaimError(f"{where}: {quoted(value)} is not a ResourceClaim name")
    return value


def pod_claim_names(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """The ResourceClaims the pod uses, by name (in its namespace), each once, as kubelet finds them:
    a ``spec.resourceClaims`` entry's ``resourceClaimName``, or for one made from a template the name
    its ``status.resourceClaimStatuses`` entry gives (an entry without a name needed no claim); and the
    claim the scheduler made for extended resources (``status.extendedResourceClaimStatus``).
    ClaimError (naming the pod and field) when a template's claim isn't named in the status yet."""
    key = pod_key(pod)
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    made = {entry.get("name"): entry for entry in status.get("resourceClaimStatuses") or [] if isinstance(entry, dict)}
    names = []
    for i, entry in enumerate(spec.get("resourceClaims") or []):
        where = f"pod {key} spec.resourceClaims[{i}]"
        if not isinstance(entry, dict):
            raise ClaimError(f"{where}: {quoted(entry)} is not an object")
        name = _claim_name(entry.get("resourceClaimName"), f"{where}.resourceClaimName")
        if name is None:
            generated = made.get(entry.get("name"))
            if generated is None:
                raise ClaimError(
                    f"{where} ({quoted(entry.get('name'))}): status.resourceClaimStatuses names no ResourceClaim "
                    "made for it yet"
                )
            name = _claim_name(generated.get("resourceClaimName"), f"pod {key} status.resourceClaimStatuses")
        if name is not None:
            names.append(name)
    extended = _claim_name(
        (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName"),
        f"pod {key} status.extendedResourceClaimStatus.resourceClaimName",
    )
    if extended is not None:
        names.append(extended)
    return tuple(dict.fromkeys(names))


def _reserved_pods(claim: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    return [r for r in reserved if isinstance(r, dict) and r.get("resource", "pods") == "pods"]


def _pod_claim(claim: Mapping[str, Any], namespace: str, name: str, pod: str, uid: str) -> ClaimRef:
    """The claim's reference, once it is known to be this pod's to hold: reserved for it, and for no pod
    before it.

    A claim's memory is one budget, however many containers or pods use it: each pod's cgroup is
    limited on its own (:mod:`gpushare.memlimits`), so two pods each given a shared claim's whole
    allocation could fill its card past its memory, and a division between them would change the
    limits of running pods whenever one joins or leaves. So the claim serves one pod at a time: the
    first pod in ``status.reservedFor`` (kube-scheduler appends each pod it binds, in PreBind, and the
    resourceclaim controller drops finished pods keeping the others' order: kubernetes v1.37.2
    ``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`` and
    ``pkg/controller/resourceclaim/controller.go``); a later pod is refused, naming the pod it waits
    for, and its containers are created once that pod is done. The containers of one pod share its
    claims freely: they are limited together, in the pod's cgroup."""
    ref = ClaimRef(namespace, name, str((claim.get("metadata") or {}).get("uid", "")))
    pods = _reserved_pods(claim)
    if not any(r.get("uid") == uid for r in pods):
        raise ClaimError(f"ResourceClaim {ref}: status.reservedFor does not name pod {pod} (uid {uid})")
    holder = pods[0]
    if holder.get("uid") != uid:
        raise ClaimError(
            f"ResourceClaim {ref} is in use by pod {namespace}/{holder.get('name', '?')} (uid {holder.get('uid')}) "
            f"as well as pod {pod}: a claim's GPU memory is one budget, used by one pod at a time; pod {pod} "
            "waits until that pod is done (or give each pod its own claim, e.g. from a ResourceClaimTemplate)"
        )
    return ref


def _pod_claims(
    pod: Mapping[str, Any], claims: Mapping[str, dict[str, Any]], node: str, inventory: NodeInventory
) -> dict[str, tuple[ClaimRef, dict[str, tuple[CardSlice, ...]]]]:
    """Each of the pod's claims by UID: its reference and its card slices on ``node`` by request."""
    meta = pod.get("metadata") or {}
    namespace, uid = meta.get("namespace", "default"), meta.get("uid", "")
    result = {}
    for name, claim in claims.items():
        ref = _pod_claim(claim, namespace, name, pod_key(pod), uid)
        allocation = ClaimAllocation(ref, node, node_shares(claim, f"ResourceClaim {ref}", node))
        result[ref.uid] = (ref, card_slices(allocation, inventory.cards, inventory.unit.mib))
    return result


def dra_held(
    pod: Mapping[str, Any], claims: Mapping[str, dict[str, Any]], node: str, inventory: NodeInventory
) -> dict[str, int]:
    """Units the pod holds per card UUID through its ResourceClaims ``claims`` (name -> the claim as
    the API server returns it; :func:`pod_claim_names` says which): on each card, the sum of their
    allocation results of driver ``gpu.gpushare.io`` in pool ``node`` (a claim of other drivers adds
    nothing). Each claim must be the pod's to hold (reserved for it and for no pod before it; see
    :func:`_pod_claim`). ClaimError (naming the claim and field) when one can't be counted: a result
    naming a card the node lacks, or not a whole number of units."""
    held: dict[str, int] = {}
    for _, by_request in _pod_claims(pod, claims, node, inventory).values():
        for slices in by_request.values():
            for part in slices:
                held[part.uuid] = held.get(part.uuid, 0) + part.units
    return held


def dra_env(
    pod: Mapping[str, Any],
    claims: Mapping[str, dict[str, Any]],
    devices: Sequence[str],
    node: str,
    inventory: NodeInventory,
) -> dict[str, str]:
    """The GPU env of a container kubelet gave the claims' CDI ``devices``: every card of every request
    they name, once each, in the order of the pod's claims and their allocation results (kubelet's
    order of the devices varies), with the units summed per card, as
    :func:`gpushare.contract.env.assigned_env` writes them (``ALIYUN_COM_GPU_MEM_POD``: what the pod
    holds through all its claims here).

    One rule for every container, whatever the number of its claims: the runtime applies CDI env edits
    over the container's own env, the last device's value winning (containerd v2.2
    ``internal/cri/opts/spec_linux.go`` ``WithCDI`` runs after ``oci.WithEnv`` of the CRI config, and
    tags.cncf.io/container-device-interface v1.1.0 ``Cache.InjectDevices`` appends every device's env
    and applies it with runtime-tools' ``AddMultipleProcessEnv``, which replaces a key already set). So
    the claims' CDI specs set none of these variables and the CRI shim sets them in the container's
    config. ClaimError when a device names no claim of the pod (reserved for it) or no request of one
    allocated on ``node``, or when a claim can't be counted (:func:`dra_held`)."""
    by_uid = _pod_claims(pod, claims, node, inventory)
    given: set[tuple[str, str]] = set()
    for device in devices:
        parsed = parse_claim_cdi_device(device, by_uid)
        if parsed is None:
            named = ", ".join(str(ref) for ref, _ in by_uid.values()) or "none"
            raise ClaimError(f"CDI device {device} names no ResourceClaim of pod {pod_key(pod)} (its claims: {named})")
        ref, by_request = by_uid[parsed[0]]
        if parsed[1] not in by_request:
            raise ClaimError(
                f"CDI device {device}: ResourceClaim {ref} has no request {parsed[1]} allocated a card of node {node}"
            )
        given.add(parsed)
    merged: dict[str, CardSlice] = {}
    for uid, (_, by_request) in by_uid.items():  # the pod's order, not kubelet's order of the devices
        for request, slices in by_request.items():
            for part in slices if (uid, request) in given else ():
                before = merged.get(part.uuid)
                merged[part.uuid] = replace(part, units=part.units + (before.units if before else 0))
    pod_units = sum(p.units for _, by_request in by_uid.values() for ss in by_request.values() for p in ss)
    return assigned_env(tuple(merged.values()), pod_units, {c.uuid: inventory.units_of(c) for c in inventory.cards})
