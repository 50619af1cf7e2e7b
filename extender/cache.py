"""The extender's view of the cluster: every node's cards (from the advertiser's annotation) and what
the pods bound to it hold (from their annotations), plus the binds this replica has in flight.

Each node carries a generation that moves whenever its inventory or one of its pods changes, so
per-node placement answers can be memoised until something on that node changes.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from gpushare import placement
from gpushare.contract import (
    ANN_ALLOCATION,
    ANN_FRAMEWORK_ALLOCATION,
    NODE_ANN_INVENTORY,
    RESOURCE_CPU,
    RESOURCE_MEMORY,
    Allocation,
    ContractError,
    NodeInventory,
    annotations_of,
    parse_framework_allocation,
    parse_inventory,
    parse_pod_request,
    pod_key,
)
from gpushare.kube import WatchCache
from gpushare.usage import holds_resources, node_usage

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    inventory: NodeInventory
    cards: tuple[placement.Card, ...]
    generation: int


def demands_of(pod: Mapping[str, Any]) -> tuple[placement.Demand, ...]:
    """The pod's GPU containers as placement demands; raises ContractError on a bad request."""
    return tuple(
        placement.Demand(
            container=c.name, units=0 if c.exclusive else c.units_per_card, cards=c.cards, exclusive=c.exclusive
        )
        for c in parse_pod_request(pod).gpu_containers
    )


#: what a node or pod without a readable CPU or memory figure is taken to have: no limit
UNLIMITED = 1 << 60


def _host_amounts(resources: Mapping[str, Any] | None) -> tuple[int, int]:
    """(CPU milli, memory bytes) of a requests or allocatable map; a missing or unreadable entry is 0."""
    amounts = []
    for name, scale in ((RESOURCE_CPU, 1000), (RESOURCE_MEMORY, 1)):
        try:
            amounts.append(int(parse_quantity((resources or {}).get(name, 0)) * scale))
        except (ValueError, TypeError, ArithmeticError):
            amounts.append(0)
    return amounts[0], amounts[1]


def host_request(pod: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's (CPU milli, memory bytes) request as kube-scheduler counts it: per resource, the larger
    of the app containers' sum and the largest init container."""
    spec = pod.get("spec") or {}
    apps = [_host_amounts((c.get("resources") or {}).get("requests")) for c in spec.get("containers") or []]
    inits = [_host_amounts((c.get("resources") or {}).get("requests")) for c in spec.get("initContainers") or []]
    return (
        max(sum(a[0] for a in apps), max((i[0] for i in inits), default=0)),
        max(sum(a[1] for a in apps), max((i[1] for i in inits), default=0)),
    )


def host_allocatable(node: Mapping[str, Any]) -> tuple[int, int]:
    """The node's allocatable (CPU milli, memory bytes); ``UNLIMITED`` for a figure the node doesn't give."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    cpu, memory = _host_amounts(allocatable)
    return (cpu if RESOURCE_CPU in allocatable else UNLIMITED, memory if RESOURCE_MEMORY in allocatable else UNLIMITED)


def framework_allocation(pod: Mapping[str, Any], inventory: NodeInventory) -> Allocation | None:
    """The allocation of a live pod annotated only by the newer original extender (its per-container
    ``{"<containerIndex>": {"<gpuIndex>": units}}``), or None for any other pod."""
    ann = annotations_of(pod)
    if ANN_ALLOCATION in ann or ANN_FRAMEWORK_ALLOCATION not in ann or not holds_resources(pod):
        return None
    uuids = {card.index: card.uuid for card in inventory.cards}
    return parse_framework_allocation(ann[ANN_FRAMEWORK_ALLOCATION], parse_pod_request(pod), uuids)


def placement_cards(
    inventory: NodeInventory, pods: Iterable[Mapping[str, Any]], extra: Iterable[Allocation] = ()
) -> tuple[placement.Card, ...]:
    """The node's cards with the units held by ``pods`` (and ``extra`` allocations) marked used.

    Pods carry one of three annotation sets: ours, the newer original extender's per-container map,
    or only the original card index; each is counted once, from the most precise set it has.
    """
    indexed, extra = [], list(extra)
    for pod in pods:
        try:
            framework = framework_allocation(pod, inventory)
        except ContractError as exc:
            log.warning("pod %s: its GPU annotations can't be read, its cards are not counted: %s", pod_key(pod), exc)
            continue
        if framework is None:
            indexed.append(pod)
        else:
            extra.append(framework)
    used, _, bad = node_usage(indexed, inventory.cards)
    for pod in bad:
        log.warning("pod %s: its GPU annotations can't be read, its cards are not counted: %s", pod.key, pod.reason)
    for allocation in extra:
        for slices in allocation.values():
            for s in slices:
                used[s.uuid] = used.get(s.uuid, 0) + s.units
    return tuple(
        placement.Card(
            index=card.index,
            uuid=card.uuid,
            capacity=inventory.units_of(card),
            used=used.get(card.uuid, 0),
            healthy=card.healthy,
            numa=card.numa_node,
            nvlink=frozenset(card.nvlink_peers),
            model=card.model,
        )
        for card in inventory.cards
    )


class ClusterCache:
    def __init__(self, api: Any) -> None:
        self.nodes = WatchCache(api, "nodes")
        self.pods = WatchCache(api, "pods")
        self._lock = threading.RLock()
        self._counter = itertools.count(1)
        self._generation: dict[str, int] = {}
        self._inventory: dict[str, NodeInventory | str] = {}
        self._pods_by_node: dict[str, dict[str, Mapping[str, Any]]] = {}
        self._node_of_pod: dict[str, str] = {}
        self._assumed: dict[str, tuple[str, Allocation]] = {}
        self._views: dict[str, NodeView] = {}
        self._shapes: Counter[placement.Shape] = Counter()
        self._shapes_of_pod: dict[str, tuple[placement.Shape, ...]] = {}
        self.shapes_version = 0
        #: per node: allocatable (CPU milli, memory bytes); and the free amounts per node, until it changes
        self._allocatable: dict[str, tuple[int, int]] = {}
        self._host_free: dict[str, tuple[int, int]] = {}
        #: the (GPU shape, CPU, memory) of every pod, GPU or not, that the host-aware policy learns from
        self._pod_shapes: Counter[tuple[placement.Shape, int, int]] = Counter()
        self._pod_shapes_of_pod: dict[str, tuple[tuple[placement.Shape, int, int], ...]] = {}
        self._change_listeners: list[Callable[[str], None]] = []
        self.nodes.add_listener(self._on_node)
        self.pods.add_listener(self._on_pod)

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        self.nodes.start()
        self.pods.start()

    def stop(self) -> None:
        self.nodes.stop()
        self.pods.stop()

    @property
    def synced(self) -> bool:
        return self.nodes.synced and self.pods.synced

    def wait_synced(self, timeout: float | None) -> bool:
        return self.nodes.wait_synced(timeout) and self.pods.wait_synced(timeout)

    # --- events -----------------------------------------------------------------------------------------

    def _bump(self, node: str) -> None:
        self._generation[node] = next(self._counter)
        self._views.pop(node, None)
        self._host_free.pop(node, None)
        for listener in self._change_listeners:
            listener(node)

    def add_change_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(node)`` after anything on ``node`` changed; called under the cache's lock, so it must
        not call back into the cache."""
        with self._lock:
            self._change_listeners.append(fn)
            for node in self._generation:
                fn(node)

    def _on_node(self, kind: str, node: Mapping[str, Any]) -> None:
        name = (node.get("metadata") or {}).get("name", "")
        with self._lock:
            if kind == "DELETED":
                self._inventory.pop(name, None)
                self._allocatable.pop(name, None)
            else:
                self._allocatable[name] = host_allocatable(node)
                text = annotations_of(node).get(NODE_ANN_INVENTORY)
                try:
                    self._inventory[name] = (
                        parse_inventory(text, name)
                        if text
                        else "has no gpushare inventory (is the advertiser running?)"
                    )
                except ContractError as exc:
                    self._inventory[name] = str(exc)
            self._bump(name)

    def _on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        key = pod_key(pod)
        node = (pod.get("spec") or {}).get("nodeName") or ""
        uid = (pod.get("metadata") or {}).get("uid", "")
        with self._lock:
            previous = self._node_of_pod.pop(key, None)
            if previous is not None:
                self._pods_by_node.get(previous, {}).pop(key, None)
                self._bump(previous)
            if kind != "DELETED" and node:
                self._pods_by_node.setdefault(node, {})[key] = pod
                self._node_of_pod[key] = node
                self._bump(node)
            if kind == "DELETED" or ANN_ALLOCATION in annotations_of(pod) or not holds_resources(pod):
                # the pod's own annotation (or its end) now speaks for what we assumed
                assumed = self._assumed.pop(uid, None)
                if assumed is not None:
                    self._bump(assumed[0])
            self._observe_shapes(key, pod if kind != "DELETED" else None)
            self._observe_pod_shapes(key, pod if kind != "DELETED" else None)

    def _observe_pod_shapes(self, key: str, pod: Mapping[str, Any] | None) -> None:
        """Keep the histogram of pod shapes with their CPU and memory (``Shape(0, 0)`` for no GPU)."""
        self._pod_shapes.subtract(self._pod_shapes_of_pod.pop(key, ()))
        if pod is None:
            return
        try:
            shapes = tuple(d.shape for d in demands_of(pod)) or (placement.Shape(0, 0),)
        except (ContractError, ValueError):
            return
        cpu, memory = host_request(pod)
        entries = tuple((shape, cpu, memory) for shape in shapes)
        self._pod_shapes.update(entries)
        self._pod_shapes_of_pod[key] = entries

    def _observe_shapes(self, key: str, pod: Mapping[str, Any] | None) -> None:
        """Keep the histogram of GPU demand shapes that the fragmentation-aware policy learns from."""
        old = self._shapes_of_pod.pop(key, ())
        try:
            new = tuple(d.shape for d in demands_of(pod)) if pod is not None else ()
        except (ContractError, ValueError):
            new = ()
        if old == new:
            if new:
                self._shapes_of_pod[key] = new
            return
        self._shapes.subtract(old)
        self._shapes.update(new)
        if new:
            self._shapes_of_pod[key] = new
        self.shapes_version += 1

    # --- queries ----------------------------------------------------------------------------------------

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(self._inventory)

    def problem(self, node: str) -> str | None:
        """Why ``node`` can't take GPU pods at all, or None."""
        with self._lock:
            inventory = self._inventory.get(node)
        if inventory is None:
            return "is not known to the gpushare extender"
        return inventory if isinstance(inventory, str) else None

    def view(self, node: str) -> NodeView | None:
        with self._lock:
            cached = self._views.get(node)
            if cached is not None:
                return cached
            inventory = self._inventory.get(node)
            if not isinstance(inventory, NodeInventory):
                return None
            pods = list(self._pods_by_node.get(node, {}).values())
            extra = [alloc for (n, alloc) in self._assumed.values() if n == node]
            view = NodeView(node, inventory, placement_cards(inventory, pods, extra), self._generation.get(node, 0))
            self._views[node] = view
            return view

    def pods_on(self, node: str) -> list[Mapping[str, Any]]:
        with self._lock:
            return list(self._pods_by_node.get(node, {}).values())

    def observed_shapes(self) -> list[placement.Shape]:
        with self._lock:
            return list(self._shapes.elements())

    def observed_pod_shapes(self) -> list[tuple[placement.Shape, int, int]]:
        """Every pod's (GPU shape, CPU milli, memory bytes), one entry per GPU container."""
        with self._lock:
            return list(self._pod_shapes.elements())

    def host_free(self, node: str) -> tuple[int, int]:
        """The node's allocatable (CPU milli, memory bytes) less the requests of the pods that hold
        resources on it (``UNLIMITED`` where the node gives no figure)."""
        with self._lock:
            held = self._host_free.get(node)
            if held is None:
                cpu, memory = self._allocatable.get(node, (UNLIMITED, UNLIMITED))
                for pod in self._pods_by_node.get(node, {}).values():
                    if holds_resources(pod):
                        pod_cpu, pod_memory = host_request(pod)
                        cpu, memory = cpu - pod_cpu, memory - pod_memory
                held = self._host_free[node] = (cpu, memory)
            return held

    # --- in-flight binds ------------------------------------------------------------------------------

    def assume(self, uid: str, node: str, allocation: Allocation) -> None:
        with self._lock:
            self._assumed[uid] = (node, allocation)
            self._bump(node)

    def forget(self, uid: str) -> None:
        with self._lock:
            assumed = self._assumed.pop(uid, None)
            if assumed is not None:
                self._bump(assumed[0])

    def assumed_on(self, node: str) -> list[tuple[str, Allocation]]:
        with self._lock:
            return [(uid, alloc) for uid, (n, alloc) in self._assumed.items() if n == node]
