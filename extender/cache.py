"""The extender's view of the cluster, mirrored from its watches: every node's cards (from the
advertiser's annotation), its ledger, and what the pods bound to it hold (from their annotations), with
each pod's ask read once as the watch brings it.

It composes what it learns beside the mirror, each part in a module of its own: the workload the
fragmentation-aware policies learn (:mod:`.workload`), the gang holds in the ledgers (:mod:`.holds`),
the fenced cards (:mod:`.fences`) and this replica's binds in flight (:mod:`.inflight`). One lock
guards them all.

Each node carries a generation that moves whenever its inventory or one of its pods changes, so
per-node placement answers can be memoised until something on that node changes. Filter, prioritize
and the gang planner read a node through its :class:`~gpushare.extender.nodeview.NodeView`, built from
all of this once per generation; binds, which read the node afresh from the API server, take the few
parts they need beside it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from gpushare.extender.agents import agent_refusal, agent_up, is_node_agent
from gpushare.extender.asks import PodAsk, read_ask
from gpushare.extender.dra import DraView
from gpushare.extender.fences import Fences
from gpushare.extender.holds import NodeHolds
from gpushare.extender.inflight import InFlight
from gpushare.extender.nodeview import NodeView, ParsedNode, build_view, parse_node
from gpushare.extender.workload import ObservedWorkload, PodShape

from gpushare import placement
from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import FENCE_CONFIGMAP_NAMESPACE, NODE_ANN_PENDING_BINDS, PLACEMENT_ANNOTATIONS
from gpushare.contract.pending import Ledger, PendingBind
from gpushare.contract.request import PodRequest, annotations_of
from gpushare.holdings.node import node_ledger
from gpushare.holdings.pod import holds_resources
from gpushare.kube.watch import WatchCache

log = logging.getLogger(__name__)

#: deleted pods whose uids are kept; a ledger entry of an older one costs a read of its pod
GONE_KEPT = 100_000


class ClusterCache:
    def __init__(self, api: Any, dra_steering: bool = False, node_agent_namespace: str = "") -> None:
        self.nodes = WatchCache(api, "nodes")
        self.pods = WatchCache(api, "pods")
        self.configmaps = WatchCache(api, "configmaps", namespace=FENCE_CONFIGMAP_NAMESPACE)
        #: with ``dra_steering``, the DRA driver's cards and claims; not part of readiness (clusters without
        #: resource.k8s.io/v1 never list them): a DRA pod asked about before they are listed scores 0
        #: everywhere. Without, the extender neither watches them nor scores DRA pods as such.
        self.dra = DraView(api) if dra_steering else None
        self._lock = threading.RLock()
        self._counter = itertools.count(1)
        self._generation: dict[str, int] = {}
        #: node -> what its object says, as last read
        self._parsed: dict[str, ParsedNode] = {}
        #: node -> its ledger (see gpushare.contract.pending), as last read while it could be read
        self._ledgers: dict[str, Ledger] = {}
        #: node -> why its ledger can't be read now
        self._damaged: dict[str, str] = {}
        #: every pod (by key) with its ask, as the watch last brought it
        self._pods: dict[str, tuple[Mapping[str, Any], PodAsk]] = {}
        self._pods_by_node: dict[str, dict[str, Mapping[str, Any]]] = {}
        self._node_of_pod: dict[str, str] = {}
        self._in_flight = InFlight()
        self._fences = Fences()
        self._holds = NodeHolds()
        self._workload = ObservedWorkload()
        #: node -> its view, until something on it changes (see :meth:`_bump`)
        self._views: dict[str, NodeView] = {}
        #: see :mod:`gpushare.extender.agents`: per node where the node agent ran as a pod of
        #: ``node_agent_namespace``, the keys of its agent pods that are up (none: no GPU pods there)
        self._agent_namespace = node_agent_namespace
        self._agents_up: dict[str, set[str]] = {}
        self._change_listeners: list[Callable[[str], None]] = []
        self._pod_listeners: list[Callable[[str, Mapping[str, Any], PodAsk], None]] = []
        #: uids of pods seen deleted (oldest first), so a ledger entry of one is dropped without a read
        self._gone: OrderedDict[str, None] = OrderedDict()
        self.nodes.add_listener(self._on_node)
        self.pods.add_listener(self._on_pod)
        self.configmaps.add_listener(self._on_configmap)

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        self.nodes.start()
        self.pods.start()
        self.configmaps.start()
        if self.dra is not None:
            self.dra.start()

    def stop(self) -> None:
        self.nodes.stop()
        self.pods.stop()
        self.configmaps.stop()
        if self.dra is not None:
            self.dra.stop()

    @property
    def synced(self) -> bool:
        return self.nodes.synced and self.pods.synced and self.configmaps.synced

    def wait_synced(self, timeout: float | None) -> bool:
        return (
            self.nodes.wait_synced(timeout) and self.pods.wait_synced(timeout) and self.configmaps.wait_synced(timeout)
        )

    # --- events -----------------------------------------------------------------------------------------

    def _bump(self, node: str) -> None:
        self._generation[node] = next(self._counter)
        self._views.pop(node, None)
        for listener in self._change_listeners:
            listener(node)

    def add_change_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(node)`` after anything on ``node`` changed; called under the cache's lock, so it must
        not call back into the cache."""
        with self._lock:
            self._change_listeners.append(fn)
            for node in self._generation:
                fn(node)

    def add_pod_listener(self, fn: Callable[[str, Mapping[str, Any], PodAsk], None]) -> None:
        """``fn(kind, pod, ask)`` for each pod event, after the cache has applied it (outside its lock)."""
        self._pod_listeners.append(fn)

    def _on_node(self, kind: str, node: Mapping[str, Any]) -> None:
        name = (node.get("metadata") or {}).get("name", "")
        with self._lock:
            if kind == "DELETED":
                self._parsed.pop(name, None)
                self._ledgers.pop(name, None)
                self._damaged.pop(name, None)
            else:
                self._parsed[name] = parse_node(node)
                self._note_ledger(name, node)
            self._holds.note(name, self._ledgers.get(name, {}))
            self._bump(name)

    def _note_ledger(self, name: str, node: Mapping[str, Any]) -> None:
        """Keep the node's ledger; one that can't be read leaves the last one read in place (what the pods
        were recorded to hold, which their owners can't rewrite), and with none the node takes no GPU pods
        until the ledger is repaired; under the lock."""
        try:
            ledger = node_ledger(node)
        except ContractError as exc:
            problem = str(exc)
            if self._damaged.get(name) != problem:
                trusted = self._ledgers.get(name)
                then = (
                    f"its pods are counted by the {len(trusted)} entries last read, and its next bind rewrites it "
                    "from them"
                    if trusted is not None
                    else "no ledger of it was read before, so it takes no GPU pods until it is repaired "
                    "(see docs/operations.md)"
                )
                log.error("%s; %s", problem, then)
            self._damaged[name] = problem
            return
        if self._damaged.pop(name, None) is not None:
            log.info("node %s: its ledger (annotation %s) is readable again", name, NODE_ANN_PENDING_BINDS)
        self._ledgers[name] = ledger

    def trusted_ledger(self, node: str) -> Ledger | None:
        """The node's ledger as last read while it could be read, or None when it never could."""
        with self._lock:
            return self._ledgers.get(node)

    def _waiting(self, uid: str, entry: PendingBind) -> bool:
        """Whether the member ``uid`` that ``entry`` holds cards for is known, unbound and not in flight;
        under the lock."""
        known = self._pods.get(entry.pod)
        if known is None or known[1].uid != uid or uid in self._in_flight:
            return False
        return not (known[0].get("spec") or {}).get("nodeName")

    def _on_configmap(self, kind: str, configmap: Mapping[str, Any]) -> None:
        with self._lock:
            node = self._fences.apply(kind, configmap)
            if node is not None:
                self._bump(node)

    def _on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        ask = read_ask(pod)
        key, uid = ask.key, ask.uid
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if node and kind != "DELETED" and isinstance(ask.host_read, ContractError):
            # the filter refuses such a pod; one bound nonetheless is left out of its node's CPU and memory
            log.warning("%s; not counted in node %s's free CPU and memory", ask.host_read, node)
        with self._lock:
            previous = self._node_of_pod.pop(key, None)
            if previous is not None:
                self._pods_by_node.get(previous, {}).pop(key, None)
                self._bump(previous)
            if kind == "DELETED":
                self._pods.pop(key, None)
            else:
                self._pods[key] = (pod, ask)
                if node:
                    self._pods_by_node.setdefault(node, {})[key] = pod
                    self._node_of_pod[key] = node
                    self._bump(node)
            for held_on in self._holds.nodes_of(uid):
                self._bump(held_on)  # a held member was created, bound or deleted
            if kind == "DELETED" and uid:
                self._gone[uid] = None
                if len(self._gone) > GONE_KEPT:
                    self._gone.popitem(last=False)
            placed = any(key in annotations_of(pod) for key in PLACEMENT_ANNOTATIONS)
            if kind == "DELETED" or placed or not holds_resources(pod):
                # the pod's own annotation (or its end) now speaks for what we assumed
                assumed = self._in_flight.drop(uid)
                if assumed is not None:
                    self._bump(assumed)
            self._workload.observe(key, ask if kind != "DELETED" else None)
            if node and is_node_agent(pod, self._agent_namespace):
                up = self._agents_up.setdefault(node, set())
                if kind != "DELETED" and agent_up(pod):
                    up.add(key)
                else:
                    up.discard(key)
        for listener in self._pod_listeners:
            listener(kind, pod, ask)

    # --- queries ----------------------------------------------------------------------------------------

    def gone(self, uid: str) -> bool:
        """Whether the pod with this uid was seen deleted (among the last :data:`GONE_KEPT`): a uid is
        never used again, so it stays gone."""
        with self._lock:
            return uid in self._gone

    def pod(self, namespace: str, name: str) -> tuple[Mapping[str, Any], PodAsk] | None:
        """The pod as the watch last brought it, with its ask; None when the watch has none by that name."""
        with self._lock:
            return self._pods.get(f"{namespace}/{name}")

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(self._parsed)

    def agent_problem(self, node: str) -> str | None:
        """Why ``node`` takes no GPU pods while its node agent pod is not up, or None."""
        with self._lock:
            down = self._agents_up.get(node) == set()
        return agent_refusal(node) if down else None

    def problem(self, node: str) -> str | None:
        """Why ``node`` can't take GPU pods at all (a sentence naming it), or None."""
        with self._lock:
            parsed = self._parsed.get(node)
            untrusted = self._damaged.get(node) if node not in self._ledgers else None
        if parsed is None:
            return f"node {node} is not known to the gpushare extender"
        if isinstance(parsed.inventory, str):
            return parsed.inventory
        if untrusted:
            return f"node {node} takes no GPU pods until its ledger is repaired: {untrusted}"
        return self.agent_problem(node)

    def view(self, node: str) -> NodeView | None:
        """The node as filter, prioritize and the gang planner read it, built once after each change on
        it; None while it can't take GPU pods (see :meth:`problem`)."""
        with self._lock:
            cached = self._views.get(node)
            if cached is not None:
                return cached
            parsed = self._parsed.get(node)
            if parsed is None or not isinstance(parsed.inventory, NodeInventory):
                return None
            if node not in self._ledgers or self.agent_problem(node):
                return None
            holds = self._holds.counted(node, time.time(), self._waiting)
            self._holds.expire_at(node, holds.values())
            view = build_view(
                node,
                parsed.inventory,
                parsed,
                self._generation.get(node, 0),
                self._ledgers[node],
                self._fences.of(node),
                [self._pods[key] for key in self._pods_by_node.get(node, {})],
                self._in_flight.on(node),
                holds,
            )
            self._views[node] = view
            return view

    def ledger(self, node: str) -> Ledger:
        """The node's ledger as last seen."""
        with self._lock:
            return self._ledgers.get(node, {})

    def pods_on(self, node: str) -> list[Mapping[str, Any]]:
        with self._lock:
            return list(self._pods_by_node.get(node, {}).values())

    def requests_on(self, node: str) -> dict[str, PodRequest | ContractError]:
        """The request (or why it can't be read) of each pod bound to ``node``, by pod key."""
        with self._lock:
            return {key: self._pods[key][1].request_read for key in self._pods_by_node.get(node, {})}

    @property
    def shapes_version(self) -> int:
        """Moves whenever the observed GPU demand shapes change."""
        with self._lock:
            return self._workload.version

    def observed_shapes(self) -> list[placement.Shape]:
        with self._lock:
            return self._workload.shapes()

    def observed_pod_shapes(self) -> list[PodShape]:
        """Every pod's (GPU shape, CPU milli, memory bytes, card rule), one entry per GPU container."""
        with self._lock:
            return self._workload.pod_shapes()

    # --- gang holds -----------------------------------------------------------------------------------

    def gang_holds(self, gang: str) -> dict[str, tuple[str, PendingBind]]:
        """The holds of gang ``gang`` (``namespace/name``) that count: member uid -> (node, hold). A member
        held on two nodes (while a plan moves) is given on one of them."""
        now = time.time()
        with self._lock:
            return {
                uid: (node, entry)
                for node in self._holds.nodes()
                for uid, entry in self._holds.counted(node, now, self._waiting).items()
                if entry.gang == gang
            }

    def expire_holds(self) -> None:
        """Let the nodes whose first counted hold has expired count again without it."""
        now = time.time()
        with self._lock:
            for node in self._holds.expired(now):
                self._bump(node)

    def note_node(self, node: Mapping[str, Any]) -> None:
        """Take a node this extender has just written, before its watch brings it."""
        self.nodes.apply(dict(node))

    def fenced(self, node: str) -> frozenset[int]:
        with self._lock:
            return self._fences.of(node)

    # --- in-flight binds ------------------------------------------------------------------------------

    def assume(self, uid: str, node: str, held: Mapping[str, int]) -> None:
        """Count ``held`` (units per card UUID) on ``node`` until the pod's own annotations speak for it."""
        with self._lock:
            self._in_flight.add(uid, node, held)
            self._bump(node)

    def forget(self, uid: str) -> None:
        with self._lock:
            node = self._in_flight.drop(uid)
            if node is not None:
                self._bump(node)

    def assumed_uids(self) -> set[str]:
        with self._lock:
            return self._in_flight.uids()

    def assumed_on(self, node: str) -> list[tuple[str, Mapping[str, int]]]:
        with self._lock:
            return self._in_flight.on(node)
