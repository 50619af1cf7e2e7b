"""What ``inspect`` shows, built from plain node and pod dicts: per node its cards and its pods' holdings.

Each node is shown in its own memory unit (the one its inventory annotation declares), and each card
with its own total, so nodes with mixed card sizes or units read as they are. Nodes that carry no
inventory annotation but do advertise ``aliyun.com/gpu-mem`` (an original gpushare device plugin) are
shown as :func:`gpushare.usage.inferred_inventory` sees them, with a note saying so.

What each pod holds comes from :func:`gpushare.usage.node_usage`, as for every other component.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.cards import ENFORCED, NOT_REPORTED
from gpushare.contract.errors import ContractError
from gpushare.contract.names import NODE_ANN_INVENTORY, RESOURCE_MEM
from gpushare.contract.request import annotations_of, parse_pod_request, pod_key, requests_gpu
from gpushare.contract.units import GIB, MemoryUnit
from gpushare.usage import MIB, holds_resources, node_inventory, node_ledger, node_usage


@dataclass(frozen=True, slots=True)
class CardView:
    index: int
    total: int
    allocated: int
    healthy: bool = True
    #: as the node's inventory names it ("" when the cards were inferred from its capacity)
    model: str = ""
    #: :data:`~gpushare.cards.ENFORCED` when the driver enforces memory limits on the card, else why not
    memory_limits: str = NOT_REPORTED

    @property
    def limits_enforced(self) -> bool:
        return self.memory_limits == ENFORCED

    @property
    def overcommitted(self) -> bool:
        return self.allocated > self.total


@dataclass(frozen=True, slots=True)
class PodView:
    """One pod on a node: units per card index, or, while no card is recorded for it, the units it
    asks for (``pending``)."""

    namespace: str
    name: str
    units: Mapping[int, int]
    pending: int | None = None

    @property
    def is_pending(self) -> bool:
        return self.pending is not None


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as ``inspect`` shows it. Every figure of its cards and pods is in ``unit``, the node's own
    (nodes may differ), so totals across nodes convert first (:meth:`ClusterView.totals`)."""

    name: str
    address: str
    unit: MemoryUnit
    cards: tuple[CardView, ...]
    pods: tuple[PodView, ...]
    #: set when the cards were inferred from status.capacity: why, and what was assumed
    capacity_note: str | None = None
    #: pods whose gpushare annotations or requests could not be read
    problems: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(c.total for c in self.cards)

    @property
    def allocated(self) -> int:
        return sum(c.allocated for c in self.cards)

    @property
    def pending(self) -> int:
        return sum(p.pending or 0 for p in self.pods)

    @property
    def pending_pods(self) -> int:
        return sum(1 for p in self.pods if p.is_pending)


@dataclass(frozen=True, slots=True)
class ClusterView:
    nodes: tuple[NodeView, ...]
    #: pods that request GPUs but are not bound to any node yet
    unscheduled: int = 0

    @property
    def common_unit(self) -> MemoryUnit:
        """The unit every node uses, or MiB when they differ (totals are then converted)."""
        units = {n.unit for n in self.nodes}
        return units.pop() if len(units) == 1 else MIB

    def totals(self) -> tuple[int, int]:
        """(allocated, total) across the cluster, in :attr:`common_unit`."""
        unit = self.common_unit
        allocated = sum(n.allocated * n.unit.mib for n in self.nodes) // unit.mib
        total = sum(n.total * n.unit.mib for n in self.nodes) // unit.mib
        return allocated, total


def node_address(node: Mapping[str, Any]) -> str:
    addresses = (node.get("status") or {}).get("addresses") or []
    internal = [a.get("address") for a in addresses if a.get("type") == "InternalIP" and a.get("address")]
    if internal:
        return str(internal[0])
    return str(addresses[0].get("address")) if addresses and addresses[0].get("address") else "unknown"


def build_node(node: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> NodeView | None:
    """The node's view from the pods bound to it, or None when it has no gpushare cards."""
    name = (node.get("metadata") or {}).get("name", "?")
    try:
        inventory = node_inventory(node)
    except ContractError as exc:
        advertised = (node.get("status") or {}).get("capacity") or {}
        if NODE_ANN_INVENTORY in annotations_of(node) or RESOURCE_MEM in advertised:
            return NodeView(name, node_address(node), GIB, (), (), problems=(str(exc),))
        return None
    gpu_pods = [p for p in pods if (p.get("spec") or {}).get("nodeName") == name and requests_gpu(p)]
    try:
        ledger = node_ledger(node)
    except ContractError as exc:
        reason = f"{exc}; its pods are counted by their own annotations, which their owners can rewrite"
        ledger, ledger_problems = {}, (reason,)
    else:
        ledger_problems = ()
    used, counted, bad = node_usage(gpu_pods, inventory, ledger=ledger)
    index_of = {c.uuid: c.index for c in inventory.cards}
    views = [PodView(*p.key.split("/", 1), {index_of[u]: n for u, n in p.held.items()}) for p in counted]
    seen = {p.key for p in counted} | {b.key for b in bad}
    views += [
        PodView(*pod_key(p).split("/", 1), {}, pending=parse_pod_request(p).effective_mem)
        for p in gpu_pods
        if holds_resources(p) and pod_key(p) not in seen
    ]
    card_views = tuple(
        CardView(c.index, inventory.units_of(c), used[c.uuid], c.healthy, c.model, c.memory_limits)
        for c in inventory.cards
    )
    return NodeView(
        name=name,
        address=node_address(node),
        unit=inventory.unit,
        cards=card_views,
        pods=tuple(sorted(views, key=lambda p: (p.namespace, p.name))),
        capacity_note=inventory.inferred,
        problems=ledger_problems + tuple(b.reason for b in bad),
    )


def build_cluster(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> ClusterView:
    pods = list(pods)
    by_node: dict[str, list[Mapping[str, Any]]] = {}
    unscheduled = 0
    for pod in pods:
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name:
            by_node.setdefault(node_name, []).append(pod)
        elif holds_resources(pod) and requests_gpu(pod):
            unscheduled += 1
    views = [build_node(n, by_node.get((n.get("metadata") or {}).get("name", ""), [])) for n in nodes]
    return ClusterView(
        nodes=tuple(sorted((v for v in views if v is not None), key=lambda v: v.name)), unscheduled=unscheduled
    )
