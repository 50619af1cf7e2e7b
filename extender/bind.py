"""bind: choose the cards, write them on the pod, then create the binding.

Correctness, also with two extender replicas:
1. Under a per-node lock (within this replica), read the node and its pods fresh from the API server.
2. Place the pod on those cards, counting this replica's other in-flight binds too.
3. Write every annotation in one patch, conditional on the pod's resourceVersion.
4. Compare-and-swap a bind counter on the node, conditional on the node's resourceVersion read in 1.
   If another replica bound something to this node meanwhile, the swap fails: the pod's annotations
   are taken back and the whole sequence starts again from fresh reads.
5. Create the binding. If that fails, take the annotations back.
A write whose answer was lost (a timeout while the API server paused) may still have landed; its retry
then conflicts with its own success. So a conflict or failure is checked against what the pod now
carries before it counts: our own annotations or binding are taken as done, not as a failure.
Only pods that request a gpushare resource are bound, and only onto nodes whose cards fit them and
whose labels match the pod's nodeSelector, so the bind verb can't place a pod the filter would refuse.
Kubelet's device plugin re-checks every assignment against the node's live pods before a container
starts, so even a stale writer can never over-commit a card.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from extender.cache import ClusterCache, demands_of, placement_cards
from extender.metrics import BIND_FAILURES
from extender.verbs import Placement
from gpushare import placement
from gpushare.contract import (
    ANN_ALLOCATION,
    ANN_ASSIGNED_CONTAINERS,
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_DEV,
    ANN_MEM_IDX,
    ANN_MEM_POD,
    NODE_ANN_INVENTORY,
    Allocation,
    CardSlice,
    ContractError,
    annotations_of,
    format_allocation,
    format_assume_time,
    format_bool,
    parse_inventory,
    parse_pod_request,
    quoted,
)
from gpushare.kube import (
    BackgroundEvents,
    KubeConflict,
    KubeError,
    bind_pod,
    get_node,
    get_pod,
    list_pods,
    patch_node,
    patch_pod,
)

log = logging.getLogger(__name__)

COMPONENT = "gpushare-extender"
#: node annotation bumped by every bind: the compare-and-swap that orders binds across replicas
NODE_ANN_BIND_SEQUENCE = "gpushare.io/bind-sequence"
ATTEMPTS = 8
OUR_KEYS = (ANN_ALLOCATION, ANN_MEM_IDX, ANN_MEM_POD, ANN_MEM_DEV, ANN_MEM_ASSIGNED, ANN_MEM_ASSUME_TIME)


def selector_mismatch(pod: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """The first nodeSelector term ``node``'s labels don't satisfy, or None."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in sorted(((pod.get("spec") or {}).get("nodeSelector") or {}).items()):
        if labels.get(key) != value:
            return f"{quoted(key)}={quoted(value)}"
    return None


class BindError(Exception):
    """The bind failed; the message goes back to kube-scheduler in ``Error``."""


def allocation_of(assignments: tuple[placement.Assignment, ...]) -> Allocation:
    return {a.container: tuple(CardSlice(index, uuid, taken) for index, uuid, taken in a.cards) for a in assignments}


def pod_annotations(pod: Mapping[str, Any], allocation: Allocation, units: Mapping[str, int]) -> dict[str, str]:
    """Our allocation plus the original gpushare keys, so original device plugins still match the pod.

    The original keys name one card; for multi-card or multi-container pods that is the first
    container's first card (original device plugins can only serve single-card pods anyway).
    """
    first = next(iter(allocation.values()))[0]
    return {
        ANN_ALLOCATION: format_allocation(allocation),
        ANN_MEM_IDX: str(first.index),
        ANN_MEM_POD: str(parse_pod_request(pod).total_mem),
        ANN_MEM_DEV: str(units[first.uuid]),
        ANN_MEM_ASSIGNED: format_bool(False),
        ANN_MEM_ASSUME_TIME: format_assume_time(time.time_ns()),
    }


class Binder:
    def __init__(self, api: Any, cache: ClusterCache, engine: Placement) -> None:
        self._api = api
        self._cache = cache
        self._engine = engine
        #: a bind's Event is recorded after kube-scheduler has its answer
        self.events = BackgroundEvents(api, COMPONENT)
        #: node -> (its lock, binds holding or waiting for it); an entry lives only while a bind uses it
        self._locks: dict[str, tuple[threading.Lock, int]] = {}
        self._locks_guard = threading.Lock()

    @contextlib.contextmanager
    def _lock(self, node: str) -> Iterator[None]:
        with self._locks_guard:
            lock, users = self._locks.get(node) or (threading.Lock(), 0)
            self._locks[node] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._locks_guard:
                lock, users = self._locks[node]
                if users == 1:
                    del self._locks[node]
                else:
                    self._locks[node] = (lock, users - 1)

    @property
    def locked_nodes(self) -> int:
        """Nodes with a bind in progress (or waiting): what the per-node lock map holds."""
        with self._locks_guard:
            return len(self._locks)

    def bind(self, namespace: str, name: str, uid: str | None, node: str) -> None:
        where = f"pod {namespace}/{name} on node {node}"
        try:
            pod = get_pod(self._api, namespace, name)
        except KubeError as exc:
            BIND_FAILURES.labels(reason="pod-unreadable").inc()
            raise BindError(f"bind to node {node}: {exc}") from None
        if uid and (pod.get("metadata") or {}).get("uid") != uid:
            BIND_FAILURES.labels(reason="uid-mismatch").inc()
            raise BindError(f"bind {where}: the pod was replaced (uid {quoted(uid)} is gone)")
        try:
            demands = demands_of(pod)
        except (ContractError, ValueError) as exc:
            BIND_FAILURES.labels(reason="bad-request").inc()
            raise BindError(f"bind to node {node}: {exc}") from None
        if not demands:
            BIND_FAILURES.labels(reason="not-managed").inc()
            raise BindError(f"bind {where}: the pod requests no gpushare resource; kube-scheduler binds it")
        with self._lock(node):
            self._bind_gpu_pod(pod, demands, node, where)

    def _bind_gpu_pod(self, pod: Mapping[str, Any], demands: tuple, node: str, where: str) -> None:
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        for attempt in range(ATTEMPTS):
            try:
                if attempt:
                    pod = get_pod(self._api, namespace, name)
                _, policy = self._engine.policy_for(pod)
                node_obj = get_node(self._api, node)
                text = annotations_of(node_obj).get(NODE_ANN_INVENTORY)
                if not text:
                    raise BindError(f"bind {where}: node {node} has no gpushare inventory")
                inventory = parse_inventory(text, node)
                if mismatch := selector_mismatch(pod, node_obj):
                    BIND_FAILURES.labels(reason="node-selector").inc()
                    raise BindError(f"bind {where}: the node doesn't match the pod's nodeSelector ({mismatch})")
                others = [
                    p
                    for p in list_pods(self._api, field_selector=f"spec.nodeName={node}")
                    if (p.get("metadata") or {}).get("uid") != uid
                ]
                in_flight = [alloc for other, alloc in self._cache.assumed_on(node) if other != uid]
                cards = placement_cards(inventory, others, in_flight)
                try:
                    assignments = placement.place(cards, demands, policy, unit=inventory.unit.name)
                except placement.NoFit as nofit:
                    BIND_FAILURES.labels(reason="no-fit").inc()
                    raise BindError(f"bind {where}: {nofit.reason}") from None
                units = {c.uuid: inventory.units_of(c) for c in inventory.cards}
                allocation = allocation_of(assignments)
                if self._write(pod, node, node_obj, allocation, pod_annotations(pod, allocation, units), where):
                    return
            except ContractError as exc:
                BIND_FAILURES.labels(reason="bad-annotation").inc()
                raise BindError(f"bind to node {node}: {exc}") from None
            except KubeError as exc:
                BIND_FAILURES.labels(reason="api").inc()
                raise BindError(f"bind to node {node}: {exc}") from None
        BIND_FAILURES.labels(reason="contention").inc()
        raise BindError(f"bind {where}: the node kept changing under {ATTEMPTS} attempts; the scheduler will retry")

    def _write(
        self,
        pod: Mapping[str, Any],
        node: str,
        node_obj: Mapping[str, Any],
        allocation: Allocation,
        annotations: dict[str, str],
        where: str,
    ) -> bool:
        """Steps 3 to 5 of the module doc. False when another writer got to the node first."""
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        self._cache.assume(uid, node, allocation)
        try:
            patch_pod(
                self._api,
                namespace,
                name,
                {"metadata": {"annotations": annotations}},
                resource_version=meta.get("resourceVersion"),
            )
        except KubeConflict as exc:
            if not self._carries(namespace, name, annotations):
                self._cache.forget(uid)
                raise BindError(f"bind {where}: the pod changed while it was being bound ({exc})") from None
            log.info("bind %s: the annotation patch had landed before its answer was lost", where)
        except KubeError:
            self._undo(namespace, name, uid, where)
            raise
        sequence = int(annotations_of(node_obj).get(NODE_ANN_BIND_SEQUENCE) or 0) + 1
        try:
            patch_node(
                self._api,
                node,
                {"metadata": {"annotations": {NODE_ANN_BIND_SEQUENCE: str(sequence)}}},
                resource_version=(node_obj.get("metadata") or {}).get("resourceVersion"),
            )
        except KubeConflict:
            log.info("bind %s: node %s changed meanwhile; placing again from fresh state", where, node)
            self._undo(namespace, name, uid, where)
            return False
        except KubeError as exc:
            BIND_FAILURES.labels(reason="api").inc()
            self._undo(namespace, name, uid, where)
            raise BindError(
                f"bind {where}: recording the bind on the node failed, assignment taken back: {exc}"
            ) from None
        try:
            bind_pod(self._api, namespace, name, uid, node)
        except KubeError as exc:
            if not self._bound(namespace, name, uid, node):
                BIND_FAILURES.labels(reason="binding").inc()
                self._undo(namespace, name, uid, where)
                raise BindError(f"bind {where}: creating the binding failed, assignment taken back: {exc}") from None
            log.info("bind %s: the binding had been created before its answer was lost", where)
        cards = "; ".join(
            f"{c}: {', '.join(f'card {s.index} ({s.units})' for s in ss)}" for c, ss in allocation.items()
        )
        log.info("bound pod %s/%s to node %s: %s", namespace, name, node, cards)
        self.events.record(pod, reason="GPUAssigned", message=f"node {node}: {cards}")
        return True

    def _carries(self, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Whether the pod now holds exactly ``annotations`` (whose assume time is this attempt's own)."""
        try:
            current = annotations_of(get_pod(self._api, namespace, name))
        except KubeError:
            return False
        return all(current.get(key) == value for key, value in annotations.items())

    def _bound(self, namespace: str, name: str, uid: str, node: str) -> bool:
        """Whether the pod (this uid) is bound to ``node`` already."""
        try:
            pod = get_pod(self._api, namespace, name)
        except KubeError:
            return False
        return (pod.get("metadata") or {}).get("uid") == uid and (pod.get("spec") or {}).get("nodeName") == node

    def _undo(self, namespace: str, name: str, uid: str, where: str) -> None:
        self._cache.forget(uid)
        try:
            patch_pod(
                self._api,
                namespace,
                name,
                {"metadata": {"annotations": dict.fromkeys((*OUR_KEYS, ANN_ASSIGNED_CONTAINERS))}},
            )
        except KubeError as exc:
            log.error("bind %s: could not take the annotations back: %s", where, exc)
