"""The ``inspect`` tables, built from plain node and pod dicts.

Each node is shown in its own memory unit (the one its inventory annotation declares), and each card
with its own total, so nodes with mixed card sizes or units read as they are. Nodes that carry no
inventory annotation but do advertise ``aliyun.com/gpu-mem`` (an original gpushare device plugin, or
an advertiser that hasn't run yet) are shown from ``status.capacity``, with a note saying so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.cards import Card
from gpushare.contract import (
    GIB,
    NODE_ANN_INVENTORY,
    RESOURCE_COUNT,
    RESOURCE_MEM,
    Allocation,
    ContractError,
    MemoryUnit,
    annotations_of,
    parse_inventory,
    parse_pod_request,
    pod_allocation,
    pod_key,
    requests_gpu,
)
from gpushare.usage import holds_resources, resolve_allocation

MIB = MemoryUnit(1)


@dataclass(frozen=True, slots=True)
class CardView:
    index: int
    total: int
    allocated: int
    healthy: bool = True

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


# --- building ---------------------------------------------------------------------------------------


def node_address(node: Mapping[str, Any]) -> str:
    addresses = (node.get("status") or {}).get("addresses") or []
    internal = [a.get("address") for a in addresses if a.get("type") == "InternalIP" and a.get("address")]
    if internal:
        return str(internal[0])
    return str(addresses[0].get("address")) if addresses and addresses[0].get("address") else "unknown"


def _capacity_cards(node: Mapping[str, Any]) -> tuple[list[Card], str | None]:
    """Equal cards from the node's advertised gpu-mem and gpu-count (the original inspect's view).

    The original device plugin advertises one gpu-count per card. Ours advertises replicas (by
    default one per memory unit), so a gpu-count of at least the gpu-mem doesn't count cards: the
    node is then shown as one card holding all of its memory.
    """
    capacity = (node.get("status") or {}).get("capacity") or {}
    try:
        mem = int(str(capacity.get(RESOURCE_MEM, 0)))
        count = int(str(capacity.get(RESOURCE_COUNT, 0)))
    except ValueError:
        return [], None
    if mem <= 0:
        return [], None
    count = max(count, 1) if count < mem else 1
    share, extra = divmod(mem, count)
    cards = [
        Card(index=i, uuid="", model="", memory_mib=(share + (1 if i < extra else 0)) * GIB.mib, minor=i)
        for i in range(count)
    ]
    note = (
        f"no {NODE_ANN_INVENTORY} annotation; {count} card(s) inferred from status.capacity "
        f"({RESOURCE_MEM}={mem}, {RESOURCE_COUNT}={capacity.get(RESOURCE_COUNT, 'unset')}), "
        f"assumed equal and in {GIB.name}"
    )
    return cards, note


def _node_cards(node: Mapping[str, Any]) -> tuple[list[Card], MemoryUnit, str | None, list[str]]:
    """The node's cards, its unit, the capacity-fallback note (if used) and any problem found."""
    name = (node.get("metadata") or {}).get("name", "?")
    text = annotations_of(node).get(NODE_ANN_INVENTORY)
    problems: list[str] = []
    if text is not None:
        try:
            inventory = parse_inventory(text, name)
            return list(inventory.cards), inventory.unit, None, problems
        except ContractError as exc:
            problems.append(str(exc))
    cards, note = _capacity_cards(node)
    return cards, GIB, note, problems


def _card_units(allocation: Allocation, by_uuid: Mapping[str, int] | None, pod: str) -> dict[int, int]:
    """Units per card index. ``by_uuid`` (uuid -> index) is None when the node has no inventory."""
    units: dict[int, int] = {}
    for container, slices in allocation.items():
        for s in slices:
            index = s.index
            if by_uuid is not None:
                if s.uuid not in by_uuid:
                    raise ContractError(f"pod {pod} container {container}: card {s.uuid} is not on this node")
                index = by_uuid[s.uuid]
            units[index] = units.get(index, 0) + s.units
    return units


def _pod_view(pod: Mapping[str, Any], cards: list[Card], has_inventory: bool) -> PodView:
    meta = pod.get("metadata") or {}
    key = pod_key(pod)
    request = parse_pod_request(pod)
    if has_inventory:
        allocation = resolve_allocation(pod, cards)
        by_uuid: dict[str, int] | None = {c.uuid: c.index for c in cards}
    else:
        allocation = pod_allocation(pod, request)
        by_uuid = None
    namespace, name = meta.get("namespace", "default"), meta.get("name", "?")
    if allocation is None:
        return PodView(namespace, name, {}, pending=request.total_mem)
    units = _card_units(allocation, by_uuid, key)
    unknown = sorted(set(units) - {c.index for c in cards})
    if unknown:
        raise ContractError(f"pod {key}: card index(es) {unknown} are not on this node")
    return PodView(namespace, name, units)


def build_node(node: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> NodeView | None:
    """The node's view from the pods bound to it, or None when it has no gpushare cards."""
    cards, unit, note, problems = _node_cards(node)
    if not cards:
        return None
    name = (node.get("metadata") or {}).get("name", "?")
    views: list[PodView] = []
    for pod in pods:
        if (pod.get("spec") or {}).get("nodeName") != name or not holds_resources(pod) or not requests_gpu(pod):
            continue
        try:
            views.append(_pod_view(pod, cards, note is None))
        except ContractError as exc:
            problems.append(str(exc))
    allocated: dict[int, int] = {}
    for view in views:
        for index, units in view.units.items():
            allocated[index] = allocated.get(index, 0) + units
    card_views = tuple(
        CardView(c.index, unit.units_of(c.memory_mib), allocated.get(c.index, 0), c.healthy) for c in cards
    )
    return NodeView(
        name=name,
        address=node_address(node),
        unit=unit,
        cards=card_views,
        pods=tuple(sorted(views, key=lambda p: (p.namespace, p.name))),
        capacity_note=note,
        problems=tuple(problems),
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


# --- rendering --------------------------------------------------------------------------------------


def render_table(rows: list[list[str]], gap: int = 2) -> str:
    """Left-aligned columns, as kubectl prints them."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(len(r) for r in rows))]
    return "\n".join((" " * gap).join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


def quantity(amount: str, unit: MemoryUnit) -> str:
    """``amount`` followed by the unit: ``8/80 GiB``, ``3 MiB``, ``6 x 512MiB``."""
    return f"{amount} {unit.name}" if unit.mib in (1, 1024) else f"{amount} x {unit.name}"


def percent(part: int, whole: int) -> str:
    return f"{part * 100 // whole}%" if whole else "0%"


def _card_cell(card: CardView) -> str:
    flags = [f for f, on in (("unhealthy", not card.healthy), ("over-committed", card.overcommitted)) if on]
    cell = f"{card.allocated}/{card.total}"
    return f"{cell} ({', '.join(flags)})" if flags else cell


def _pending_cell(node: NodeView) -> str:
    return (
        f"{node.pending} ({node.pending_pods} pod{'s' if node.pending_pods != 1 else ''})" if node.pending_pods else ""
    )


def _footer(cluster: ClusterView) -> list[str]:
    lines: list[str] = []
    for node in cluster.nodes:
        if node.capacity_note:
            lines.append(f"note: node {node.name}: {node.capacity_note}")
        lines.extend(f"warning: node {node.name}: {problem}" for problem in node.problems)
    if cluster.unscheduled:
        lines.append(f"{cluster.unscheduled} pod(s) requesting GPUs are not bound to a node yet")
    return lines


def _cluster_total(cluster: ClusterView) -> str:
    allocated, total = cluster.totals()
    return f"Allocated/Total GPU memory in cluster: {quantity(f'{allocated}/{total}', cluster.common_unit)} " + (
        f"({percent(allocated, total)})"
    )


def render_summary(cluster: ClusterView) -> str:
    """One row per node: each card's allocated/total in the node's unit, pending, and the node total."""
    if not cluster.nodes:
        return "\n".join(["no node has gpushare GPUs", *_footer(cluster)])
    width = max(len(n.cards) for n in cluster.nodes)
    with_pending = any(n.pending_pods for n in cluster.nodes)
    header = ["NAME", "IPADDRESS", "UNIT", *(f"GPU{i}(Allocated/Total)" for i in range(width))]
    header += ["PENDING(Allocated)"] if with_pending else []
    rows = [[*header, "GPU Memory(Allocated/Total)"]]
    for node in cluster.nodes:
        by_index = sorted(node.cards, key=lambda c: c.index)
        cells = [_card_cell(c) for c in by_index] + ["-"] * (width - len(by_index))
        row = [node.name, node.address, node.unit.name, *cells]
        row += [_pending_cell(node)] if with_pending else []
        rows.append([*row, f"{node.allocated}/{node.total} ({percent(node.allocated, node.total)})"])
    table = render_table(rows)
    rule = "-" * max(len(line) for line in table.splitlines())
    return "\n".join([table, rule, _cluster_total(cluster), *_footer(cluster)])


def _node_details(node: NodeView) -> str:
    cards = sorted(node.cards, key=lambda c: c.index)
    with_pending = node.pending_pods > 0
    header = ["NAME", "NAMESPACE", *(f"GPU{c.index}(Allocated)" for c in cards)]
    rows = [header + (["PENDING(Allocated)"] if with_pending else [])]
    for pod in node.pods:
        row = [pod.name, pod.namespace, *(str(pod.units.get(c.index, 0)) for c in cards)]
        rows.append(row + ([str(pod.pending) if pod.is_pending else "0"] if with_pending else []))
    totals = ["Allocated/Total:", "", *(_card_cell(c) for c in cards)]
    rows.append(totals + ([_pending_cell(node)] if with_pending else []))
    lines = [
        f"NAME:       {node.name}",
        f"IPADDRESS:  {node.address}",
        f"UNIT:       {node.unit.name}",
        "",
        render_table(rows),
        "",
        f"Allocated:  {quantity(str(node.allocated), node.unit)} ({percent(node.allocated, node.total)})",
        f"Total:      {quantity(str(node.total), node.unit)}",
    ]
    return "\n".join(lines)


def render_details(cluster: ClusterView) -> str:
    """Per node: every pod with its units on each card, then the node's and the cluster's totals."""
    if not cluster.nodes:
        return render_summary(cluster)
    blocks = [_node_details(node) for node in cluster.nodes]
    rule = "-" * max(len(line) for block in blocks for line in block.splitlines())
    body = f"\n{rule}\n".join(blocks)
    return "\n".join([body, rule, _cluster_total(cluster), *_footer(cluster)])
