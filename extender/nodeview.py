"""One node as filter, prioritize and the gang planner read it: its cards with what they hold, its
ledger, fences, gang holds and binds in flight, its pods with their requests, and its free CPU, memory
and pod room, parsed together once each time something on the node changes (see
:meth:`gpushare.extender.cache.ClusterCache.view`), so a verb walking many nodes reads each from one
snapshot and never calls back into the cache piece by piece.

The per-node parsing rules live here too: what a node allocates, and its cards as the rules of
:mod:`gpushare.holdings.node` count them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.extender.asks import PodAsk

from gpushare import placement
from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import RESOURCE_CPU, RESOURCE_MEMORY, RESOURCE_PODS
from gpushare.contract.nodeselection import NodeFacts, parse_node_facts
from gpushare.contract.pending import Ledger, PendingBind
from gpushare.contract.request import PodRequest
from gpushare.contract.units import parse_host_quantity
from gpushare.holdings.node import kubelet_refusal, node_inventory, node_usage
from gpushare.holdings.pod import holds_resources

log = logging.getLogger(__name__)

#: what a node or pod without a readable CPU or memory figure is taken to have: no limit
UNLIMITED = 1 << 60


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node as the extender last saw it, with the generation it was built at; a new one is built
    after anything on the node changes, so two reads of the same generation see the same object."""

    name: str
    inventory: NodeInventory
    cards: tuple[placement.CardCapacity, ...]
    generation: int
    #: its name, labels and taints, which decide the pods it may take
    facts: NodeFacts
    ledger: Ledger
    #: minors of the cards fenced off by the unhealthy-GPU ConfigMap
    fenced: frozenset[int]
    #: the pods bound to it, and their requests (or why one can't be read) by pod key
    pods: tuple[Mapping[str, Any], ...]
    requests: Mapping[str, PodRequest | ContractError]
    #: this replica's binds in flight onto it: (pod uid, units per card UUID)
    assumed: tuple[tuple[str, Mapping[str, int]], ...]
    #: the gang holds that counted when it was built, by member uid
    holds: Mapping[str, PendingBind]
    #: allocatable (CPU milli, memory bytes) less what its pods request (``UNLIMITED`` where it gives none)
    host_free: tuple[int, int]
    #: how many more pods it takes, gang holds counted
    pod_room: int


@dataclass(frozen=True, slots=True)
class ParsedNode:
    """What the node object itself says, read once per update of it: its cards (or why the node takes no
    GPU pods), name, labels and taints, and allocatable CPU, memory and pods."""

    inventory: NodeInventory | str
    facts: NodeFacts
    allocatable: tuple[int, int]
    pods_allocatable: int


def parse_node(node: Mapping[str, Any]) -> ParsedNode:
    """Read once per node update, so a node's pods changing never re-reads the node object."""
    try:
        inventory: NodeInventory | str = kubelet_refusal(node) or node_inventory(node)
    except ContractError as exc:
        inventory = str(exc)
    return ParsedNode(inventory, parse_node_facts(node), host_allocatable(node), pods_allocatable(node))


def build_view(
    name: str,
    inventory: NodeInventory,
    parsed: ParsedNode,
    generation: int,
    ledger: Ledger,
    fenced: frozenset[int],
    pods: Sequence[tuple[Mapping[str, Any], PodAsk]],
    assumed: Sequence[tuple[str, Mapping[str, int]]],
    holds: Mapping[str, PendingBind],
) -> NodeView:
    """The view of node ``name`` (its cards ``inventory``, the rest of it ``parsed``) with ``pods`` bound
    to it, each with its ask."""
    requests = {ask.key: ask.request_read for _, ask in pods}
    extra = [held for _, held in assumed] + [entry.held for entry in holds.values()]
    listed = [pod for pod, _ in pods]
    holding = [ask for pod, ask in pods if holds_resources(pod)]
    cpu, memory = parsed.allocatable
    for ask in holding:
        host = ask.host_read
        if not isinstance(host, ContractError):  # the cache logged it when the pod came
            cpu, memory = cpu - host[0], memory - host[1]
    return NodeView(
        name=name,
        inventory=inventory,
        cards=placement_cards(inventory, listed, extra, fenced, ledger, requests),
        generation=generation,
        facts=parsed.facts,
        ledger=ledger,
        fenced=fenced,
        pods=tuple(listed),
        requests=requests,
        assumed=tuple(assumed),
        holds=dict(holds),
        # however many pods the node lists, the figures stay within what the node matrix holds
        host_free=(max(cpu, -UNLIMITED), max(memory, -UNLIMITED)),
        pod_room=parsed.pods_allocatable - len(holding) - len(holds),
    )


def pods_allocatable(node: Mapping[str, Any]) -> int:
    """How many pods the node takes (``status.allocatable.pods``); ``UNLIMITED`` when it doesn't say, or
    gives a figure that can't be read or is beyond :data:`~gpushare.contract.units.HOST_LIMIT` (logged)."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    if RESOURCE_PODS not in allocatable:
        return UNLIMITED
    where = f"node {(node.get('metadata') or {}).get('name', '?')} status.allocatable.{RESOURCE_PODS}"
    try:
        return parse_host_quantity(allocatable[RESOURCE_PODS], 1, "pods", where)
    except ContractError as exc:
        log.warning("%s; the node's pods are not counted", exc)
        return UNLIMITED


def host_allocatable(node: Mapping[str, Any]) -> tuple[int, int]:
    """The node's allocatable (CPU milli, memory bytes); ``UNLIMITED`` for a figure the node doesn't give,
    0 (logged) for one that can't be read or is beyond :data:`~gpushare.contract.units.HOST_LIMIT`:
    no pod is weighed as fitting there by it."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    where = f"node {(node.get('metadata') or {}).get('name', '?')} status.allocatable"
    amounts = []
    for name, scale, unit in ((RESOURCE_CPU, 1000, "millicores"), (RESOURCE_MEMORY, 1, "bytes")):
        if name not in allocatable:
            amounts.append(UNLIMITED)
            continue
        try:
            amounts.append(parse_host_quantity(allocatable[name], scale, unit, f"{where}.{name}"))
        except ContractError as exc:
            log.warning("%s; taken as 0", exc)
            amounts.append(0)
    return amounts[0], amounts[1]


def placement_cards(
    inventory: NodeInventory,
    pods: Iterable[Mapping[str, Any]],
    extra: Iterable[Mapping[str, int]] = (),
    fenced: frozenset[int] = frozenset(),
    ledger: Ledger | None = None,
    requests: Mapping[str, PodRequest | ContractError] | None = None,
) -> tuple[placement.CardCapacity, ...]:
    """The node's cards with the units held by ``pods`` (and ``extra``: units per card UUID of binds in
    flight) marked used, by the one rule of :mod:`gpushare.holdings.node` over the node's ``ledger``. Cards whose
    minor is in ``fenced`` (the original extender's unhealthy-GPU ConfigMap) take no new pods.
    ``requests``: the pods' requests by pod key, as read already."""
    used, _, bad = node_usage(pods, inventory, ledger=ledger, requests=requests)
    for pod in bad:
        if pod.counted:
            log.warning("GPU annotations disagree with what the pod can hold: %s", pod.reason)
        else:
            log.warning("GPU annotations can't be read, their cards are not counted: %s", pod.reason)
    for held in extra:
        for uuid, units in held.items():
            used[uuid] = used.get(uuid, 0) + units
    return tuple(
        placement.CardCapacity.of(
            card,
            inventory.units_of(card),
            used.get(card.uuid, 0),
            healthy=card.healthy and card.minor not in fenced,
        )
        for card in inventory.cards
    )
