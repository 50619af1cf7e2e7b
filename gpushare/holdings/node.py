"""A node's cards, its ledger, and the sum of what the pods on it hold.

The extender, the device plugin, the CRI shim and ``inspect`` all answer "how much of each card is
taken" from :func:`node_usage`, from plain node and pod dicts, so they can't disagree; what each pod
holds is :mod:`gpushare.holdings.pod`'s rule.

Cards: from the advertiser's inventory annotation; on a node without it (one that still runs the
original device plugin) from ``status.allocatable`` (else ``status.capacity``), as ``gpu-count``
equal cards sharing ``gpu-mem``, the way the original extender and inspect see it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpushare.cards import Card
from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.kubeletwatch import parse_watching
from gpushare.contract.names import (
    NODE_ANN_BIND_SEQUENCE,
    NODE_ANN_INVENTORY,
    NODE_ANN_KUBELET_WATCHING,
    NODE_ANN_PENDING_BINDS,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.pending import Ledger, LedgerError, PendingBind, parse_pending_binds
from gpushare.contract.request import PodRequest, annotations_of, pod_key
from gpushare.contract.units import CARDS_LIMIT, GIB, UNITS_LIMIT, MemoryUnit, bounded
from gpushare.holdings.pod import BadPod, PodCards, holds_resources, pod_cards

MIB = MemoryUnit(1)
#: the original inspect's rule: a card with more units than this counts in MiB, else in GiB
MIB_THRESHOLD = 100


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
