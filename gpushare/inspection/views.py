"""What ``inspect`` shows, built from plain node and pod dicts: per node its cards and its pods' holdings.

Each node is shown in its own memory unit (the one its inventory annotation declares), and each card
with its own total, so nodes with mixed card sizes or units read as they are. Nodes that carry no
inventory annotation but do advertise ``aliyun.com/gpu-mem`` (an original gpushare device plugin) are
shown as :func:`gpushare.holdings.node.inferred_inventory` sees them, with a note saying so.

What each pod holds comes from :func:`gpushare.holdings.node.node_usage`, as for every other component.

Cards offered through the DRA driver ``gpu.gpushare.io`` (the node's ResourceSlice, read by
:mod:`gpushare.inspection.dra`) are cards of their node too, in the node's unit, held by ResourceClaims
instead of pods. A card belongs to one way at a time; one that both the inventory and the slice list is
shown once, with what both ways allocated on it, and warned about.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpushare.cards import ENFORCED, NOT_REPORTED
from gpushare.contract.errors import ContractError
from gpushare.contract.names import NODE_ANN_INVENTORY, RESOURCE_MEM
from gpushare.contract.request import annotations_of, parse_pod_request, pod_key, requests_gpu
from gpushare.contract.resourceclaim import ClaimShare
from gpushare.contract.resourceslice import OfferedCard
from gpushare.contract.units import GIB, MIB_BYTES, MemoryUnit
from gpushare.holdings.node import MIB, node_inventory, node_ledger, node_usage
from gpushare.holdings.pod import holds_resources
from gpushare.inspection.dra import DraCards

#: how a card is offered: through the device plugin and the extender (listed in the node's inventory),
#: through the DRA driver (a device of the node's ResourceSlice), or, against the rule, both ways
DEVICE_PLUGIN, DRA, BOTH_WAYS = "device plugin", "DRA", "DRA and device plugin"
#: :attr:`CardView.memory_limits` of a card only the ResourceSlice lists, which says nothing of limits
DRA_LIMITS = "not reported for cards offered through DRA"


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
    #: :data:`DEVICE_PLUGIN`, :data:`DRA` or :data:`BOTH_WAYS`
    way: str = DEVICE_PLUGIN

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
class ClaimView:
    """One ResourceClaim holding DRA cards of a node: units per card index, and who uses it
    (``status.reservedFor``: ``pod/<name>``)."""

    namespace: str
    name: str
    users: tuple[str, ...]
    units: Mapping[int, int]


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
    #: pods whose gpushare annotations or requests could not be read, DRA allocations no card holds
    problems: tuple[str, ...] = ()
    #: the ResourceClaims holding its DRA cards
    claims: tuple[ClaimView, ...] = ()

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
    #: pods (namespace/name) that request GPUs but are not bound to any node yet
    unscheduled: tuple[str, ...] = ()
    #: ResourceSlices and ResourceClaims that could not be read, claims on no node shown
    problems: tuple[str, ...] = ()

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


def build_node(
    node: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    offered: Sequence[OfferedCard] = (),
    shares: Sequence[ClaimShare] = (),
) -> NodeView | None:
    """The node's view from the pods bound to it, the cards its ResourceSlice ``offered`` and the claims'
    ``shares`` of them, or None when it has no gpushare cards."""
    view = _device_plugin_view(node, pods, _slice_unit(offered) or GIB)
    if not offered and not shares:
        return view
    if view is None:
        view = NodeView(_name(node), node_address(node), _slice_unit(offered) or GIB, (), ())
    return _with_dra(view, offered, shares)


def _name(obj: Mapping[str, Any]) -> str:
    return (obj.get("metadata") or {}).get("name", "?")


def _slice_unit(offered: Sequence[OfferedCard]) -> MemoryUnit | None:
    """The node's unit as its slice hands memory out (a card's ``requestPolicy.default``), for a node
    whose inventory doesn't say."""
    units = [c.unit_bytes for c in offered if c.unit_bytes and c.unit_bytes % MIB_BYTES == 0]
    return MemoryUnit(units[0] // MIB_BYTES) if units else None


def _device_plugin_view(
    node: Mapping[str, Any], pods: Iterable[Mapping[str, Any]], unit: MemoryUnit
) -> NodeView | None:
    """The node's inventory cards and its pods' holdings, or None when it has no inventory; ``unit``
    when the inventory can't be read."""
    name = _name(node)
    try:
        inventory = node_inventory(node)
    except ContractError as exc:
        advertised = (node.get("status") or {}).get("capacity") or {}
        if NODE_ANN_INVENTORY in annotations_of(node) or RESOURCE_MEM in advertised:
            return NodeView(name, node_address(node), unit, (), (), problems=(str(exc),))
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


def _units(memory_bytes: int, unit: MemoryUnit) -> int:
    """The units ``memory_bytes`` of a claim take: a part of a unit is not free for anyone else either."""
    return -(-memory_bytes // unit.bytes)


def _with_dra(view: NodeView, offered: Sequence[OfferedCard], shares: Sequence[ClaimShare]) -> NodeView:
    """``view`` with the node's DRA cards and the claims holding them; a claim on a device the slice
    doesn't offer, and a card offered both ways, are warned about."""
    unit_bytes = view.unit.bytes
    devices = {c.device for c in offered}
    problems: list[str] = []
    held: dict[int, int] = {}
    claims: dict[str, ClaimView] = {}
    for share in shares:
        units = _units(share.memory_bytes, view.unit)
        users = f" ({', '.join(share.users)})" if share.users else ""
        if share.device not in devices:
            problems.append(
                f"ResourceClaim {share.key}{users} holds {view.unit.describe(units)} of device {share.device}, "
                "which the node's ResourceSlice doesn't offer (a card leaves it while unhealthy); not counted "
                "on any card"
            )
            continue
        held[share.index] = held.get(share.index, 0) + units
        claim = claims.setdefault(share.key, ClaimView(share.namespace, share.name, share.users, {}))
        claims[share.key] = replace(claim, units={**claim.units, share.index: units})
    cards = {c.index: c for c in view.cards}
    both = [c.index for c in offered if c.index in cards]
    for card in offered:
        units = held.get(card.index, 0)
        if (listed := cards.get(card.index)) is not None:
            cards[card.index] = replace(listed, allocated=listed.allocated + units, way=BOTH_WAYS)
        else:
            total = card.memory_bytes // unit_bytes
            cards[card.index] = CardView(card.index, total, units, True, card.model, DRA_LIMITS, DRA)
    if both:
        problems.append(
            f"{', '.join(f'GPU{i}' for i in both)} offered both through the device plugin (the node's inventory) "
            "and through DRA (its ResourceSlice): the extender counts only pods and the scheduler's DRA "
            "allocator only claims, so together they can over-commit a card"
        )
    return replace(
        view,
        cards=tuple(sorted(cards.values(), key=lambda c: c.index)),
        claims=tuple(sorted(claims.values(), key=lambda c: (c.namespace, c.name))),
        problems=view.problems + tuple(problems),
    )


def build_cluster(
    nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]], dra: DraCards | None = None
) -> ClusterView:
    """Every node with gpushare cards; with ``dra``, their DRA cards and claims too."""
    pods = list(pods)
    by_node: dict[str, list[Mapping[str, Any]]] = {}
    unscheduled: list[str] = []
    for pod in pods:
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name:
            by_node.setdefault(node_name, []).append(pod)
        elif holds_resources(pod) and requests_gpu(pod):
            unscheduled.append(pod_key(pod))
    dra = dra or DraCards({}, ())
    shares: dict[str, list[ClaimShare]] = {}
    for share in dra.shares:
        shares.setdefault(share.node, []).append(share)
    views, names = [], set()
    for node in nodes:
        name = _name(node)
        names.add(name)
        views.append(build_node(node, by_node.get(name, []), dra.offered.get(name, ()), shares.get(name, [])))
    elsewhere = [
        f"ResourceClaim {s.key} holds {MIB.describe(_units(s.memory_bytes, MIB))} of device {s.device} in pool "
        f"{s.node}, which is no node of the cluster"
        for s in dra.shares
        if s.node not in names
    ]
    return ClusterView(
        nodes=tuple(sorted((v for v in views if v is not None), key=lambda v: v.name)),
        unscheduled=tuple(sorted(unscheduled)),
        problems=dra.problems + tuple(elsewhere),
    )
