"""bind: choose the cards, write them on the pod, then create the binding.

Correctness, also with two extender replicas (docs/extender.md, "Running two replicas", has the
argument in full):
1. Under a per-node lock (within this replica), take the node and its pods from this replica's watch
   cache, the node's ledger of pending binds included.
2. Place the pod on those cards, counting this replica's other in-flight binds too.
3. Compare-and-swap a bind counter on the node, conditional on the node's resourceVersion taken in 1,
   in the same patch that adds the pod to the node's ledger. If anything changed the node since that
   version (another replica's bind, or a cache that lagged), the swap fails and the sequence starts
   again from a node read from the API server. A node the swap succeeded on holds every earlier bind
   of every replica in its ledger, so a cache that lags behind pods can't hide one of them.
4. Release the node, then create the binding, carrying every annotation: the API server sets them on
   the pod in the same write that binds it, so a pod is never bound without them nor annotated without
   being bound. Until the pod is seen with them, this replica counts the bind as in flight and the
   node's ledger counts it for everyone else.
A write whose answer was lost (a timeout while the API server paused) may still have landed; its retry
then conflicts with its own success. So a failed binding is checked against what the pod now carries
before it counts: bound here with our own annotations is taken as done, not as a failure. A binding that
failed otherwise puts the pod's ledger entry back as it was before this attempt.
A bind for a pod that is bound already (kube-scheduler binds a pod again when its first call timed out
and its informer had not seen the binding yet, see :meth:`Binder.bind`) changes nothing: bound to this
node it answers success, bound elsewhere, or with a bind of it under way in this replica, an error.
Only pods that request a gpushare resource are bound, and only onto nodes whose cards fit them and that
the pod's nodeSelector, required node affinity and tolerations allow, so the bind verb can't place a pod
the filter would refuse.
Kubelet's device plugin re-checks every assignment against the node's live pods before a container
starts, so even a stale writer can never over-commit a card.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.extender import podfit
from gpushare.extender.asks import PodAsk, read_ask
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.metrics import BIND_BATCH, BIND_FAILURES
from gpushare.extender.nodeview import placement_cards

from gpushare import placement
from gpushare.contract.aliyun import format_assume_time, format_bool, format_framework_allocation
from gpushare.contract.allocation import Allocation, CardSlice, format_allocation
from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_FRAMEWORK_ALLOCATION,
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_DEV,
    ANN_MEM_IDX,
    ANN_MEM_POD,
    NODE_ANN_BIND_SEQUENCE,
    NODE_ANN_PENDING_BINDS,
    PLACEMENT_ANNOTATIONS,
)
from gpushare.contract.nodeselection import node_refusal, parse_node_facts
from gpushare.contract.pending import LEDGER_BYTES, Ledger, LedgerError, PendingBind, format_pending_binds
from gpushare.contract.request import PodRequest, annotations_of
from gpushare.contract.units import MemoryUnit
from gpushare.holdings.node import alibaba_total_per_card, kubelet_refusal, node_inventory, node_ledger
from gpushare.holdings.pod import held_units, holds_resources
from gpushare.kube.errors import KubeConflict, KubeError, KubeNotFound
from gpushare.kube.events import EventRecorder
from gpushare.kube.objects import bind_pod, get_node, get_pod, list_pods, patch_node
from gpushare.placement.gangplan import taking, within

log = logging.getLogger(__name__)

COMPONENT = "gpushare-extender"
ATTEMPTS = 8


class BindError(Exception):
    """The bind failed; the message goes back to kube-scheduler in ``Error``."""


def allocation_of(assignments: tuple[placement.Assignment, ...]) -> Allocation:
    return {a.container: tuple(CardSlice(index, uuid, taken) for index, uuid, taken in a.cards) for a in assignments}


def pod_annotations(request: PodRequest, allocation: Allocation, inventory: NodeInventory) -> dict[str, str]:
    """Our allocation (on nodes whose cards we know by UUID) and the original keys, written the way
    the original components read them, so that they count the pod right after a rollback or beside us.

    The original extender and inspect take every card to hold the node's total / its card count
    (``_DEV``), number cards by their /dev/nvidia minor, and the extender counts ``_POD`` on the
    ``_IDX`` card only. So: ``_IDX`` is the minor of the pod's first card; ``_POD`` what the pod holds
    there (``_DEV`` for a whole card, and never more: the original's unsigned arithmetic would wrap
    past it); the framework annotation lists each app container's cards by minor, a whole card as
    ``_DEV``. Their device plugin matches a pod by its spec, never by ``_POD``.
    """
    by_uuid = {c.uuid: c for c in inventory.cards}
    per_card = alibaba_total_per_card(inventory)
    apps = [c for c in request.gpu_containers if not c.init and c.name in allocation]
    first = allocation[apps[0].name][0] if apps else next(iter(allocation.values()))[0]
    whole = {s.uuid for c in request.gpu_containers if c.exclusive for s in allocation.get(c.name, ())}
    amounts = {
        c.name: {by_uuid[s.uuid].minor: per_card if c.exclusive else s.units for s in allocation[c.name]} for c in apps
    }
    annotations = {
        ANN_MEM_IDX: str(by_uuid[first.uuid].minor),
        ANN_MEM_POD: str(
            per_card if first.uuid in whole else min(held_units(allocation, request)[first.uuid], per_card)
        ),
        ANN_MEM_DEV: str(per_card),
        ANN_MEM_ASSIGNED: format_bool(False),
        ANN_MEM_ASSUME_TIME: format_assume_time(time.time_ns()),
    }
    if amounts:
        annotations[ANN_FRAMEWORK_ALLOCATION] = format_framework_allocation(amounts, request)
    if inventory.inferred is None:
        annotations[ANN_ALLOCATION] = format_allocation(allocation)
    return annotations


@dataclass(frozen=True, slots=True)
class _Placed:
    """What a bind writes on the pod: its cards per container, and the annotations saying so."""

    allocation: Allocation
    annotations: dict[str, str]
    unit: MemoryUnit


@dataclass(eq=False)
class _Bind:
    """A bind waiting for its node, and how it went: placed, or refused with the error for kube-scheduler."""

    pod: Mapping[str, Any]
    ask: PodAsk
    where: str
    placed: _Placed | None = None
    error: BindError | None = None
    #: the pod is bound to the node already: nothing is written, and the bind answers success
    bound_here: bool = False
    #: the ledger entry this attempt wrote, and the pod's entry before it (put back if the binding fails)
    entry: PendingBind | None = None
    previous: PendingBind | None = None

    @property
    def uid(self) -> str:
        return self.ask.uid

    @property
    def decided(self) -> bool:
        return self.placed is not None or self.error is not None or self.bound_here


def _refuse(batch: list[_Bind], reason: str, message: Callable[[_Bind], str]) -> None:
    """Refuse the binds of ``batch`` not decided yet, counting ``reason``."""
    for request in batch:
        if not request.decided:
            BIND_FAILURES.labels(reason=reason).inc()
            request.error = BindError(message(request))


class Binder:
    def __init__(self, api: Any, cache: ClusterCache, engine: PlacementEngine) -> None:
        self._api = api
        self._cache = cache
        self._engine = engine
        #: a bind's Event is recorded after kube-scheduler has its answer
        self.events = EventRecorder(api, COMPONENT)
        #: node -> (its lock, binds holding or waiting for it); an entry lives only while a bind uses it
        self._locks: dict[str, tuple[threading.Lock, int]] = {}
        #: node -> binds waiting for its lock; whichever takes the lock first records them all
        self._waiting: dict[str, list[_Bind]] = {}
        self._locks_guard = threading.Lock()

    @contextlib.contextmanager
    def node_lock(self, node: str) -> Iterator[None]:
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

    def waiting_on(self, node: str) -> int:
        """Binds waiting for the node's lock, to be recorded together by the first that takes it."""
        with self._locks_guard:
            return len(self._waiting.get(node, ()))

    def bind(self, namespace: str, name: str, uid: str | None, node: str) -> None:
        """Bind the pod to ``node``, or BindError for kube-scheduler.

        kube-scheduler (``HTTPExtender.Bind``, pkg/scheduler/extender.go) turns a non-empty ``Error`` into
        a failed binding cycle; its failure handler then requeues the pod unless its informer shows the
        pod bound already (``handleSchedulingFailure``, pkg/scheduler/schedule_one.go). So a bind whose
        answer timed out may be sent again, to the same node or, after a new scheduling cycle, another:
        a pod bound here answers success and one bound elsewhere an error, both without a write."""
        where = f"pod {namespace}/{name} on node {node}"
        pod, ask = self._pod(namespace, name, uid, node)
        if uid and ask.uid != uid:
            BIND_FAILURES.labels(reason="uid-mismatch").inc()
            raise BindError(f"bind {where}: the pod was replaced (uid {quoted(uid)} is gone)")
        if self._bound_before(pod, node, where):
            return
        try:
            # the GPU demands and the CPU and memory requests, each parsed within its bounds
            demands, _ = ask.demands, ask.host
        except ContractError as exc:
            BIND_FAILURES.labels(reason="bad-request").inc()
            raise BindError(f"bind to node {node}: {exc}") from None
        if not demands:
            BIND_FAILURES.labels(reason="not-managed").inc()
            raise BindError(f"bind {where}: the pod requests no gpushare resource; kube-scheduler binds it")
        request = _Bind(pod, ask, where)
        with self._locks_guard:
            self._waiting.setdefault(node, []).append(request)
        with self.node_lock(node):
            if not request.decided:  # no bind before it took it along: it records those waiting now
                with self._locks_guard:
                    batch = self._waiting.pop(node)
                self._record_batch(batch, node)
        if request.error is not None:
            raise request.error
        if request.bound_here:
            log.info("bind %s: the pod is bound to the node already; nothing written", where)
            return
        assert request.placed is not None
        self._create_binding(request, node)

    def _bound_before(self, pod: Mapping[str, Any], node: str, where: str) -> bool:
        """True when ``pod`` (as read) is bound to ``node`` already; BindError when it is bound to another."""
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if not bound_to:
            return False
        if bound_to != node:
            BIND_FAILURES.labels(reason="bound-elsewhere").inc()
            raise BindError(f"bind {where}: the pod is bound to node {bound_to} already")
        log.info("bind %s: the pod is bound to the node already; nothing written", where)
        return True

    def _pod(self, namespace: str, name: str, uid: str | None, node: str) -> tuple[Mapping[str, Any], PodAsk]:
        """The pod and its ask from the watch cache when it has this uid (kube-scheduler names the pod it
        placed), else from the API server: a pod's requests can't change under one uid, and its annotations
        are gpushare's or validated by the webhook. Never from a filter's body, which anyone can forge."""
        cached = self._cache.pod(namespace, name)
        if cached is not None and uid and cached[1].uid == uid:
            return cached
        try:
            pod = get_pod(self._api, namespace, name)
            return pod, read_ask(pod)
        except KubeError as exc:
            BIND_FAILURES.labels(reason="pod-unreadable").inc()
            raise BindError(f"bind to node {node}: {exc}") from None

    def _node(self, node: str, fresh: bool) -> Mapping[str, Any]:
        """The node from the watch cache, or (``fresh``, or not cached) from the API server."""
        cached = None if fresh else self._cache.nodes.get(node)
        return cached if cached is not None else get_node(self._api, node)

    def _record_batch(self, batch: list[_Bind], node: str) -> None:
        """Steps 1 to 3 of the module doc for every bind waiting on the node, under its lock: one swap
        records them all. Each leaves decided, placed or with its error."""
        BIND_BATCH.observe(len(batch))
        try:
            for attempt in range(ATTEMPTS):
                if self._try_batch(batch, node, fresh=attempt > 0):
                    return
            _refuse(
                batch,
                "contention",
                lambda r: f"bind {r.where}: the node kept changing under {ATTEMPTS} attempts; the scheduler will retry",
            )
        except (ContractError, KubeError) as exc:
            self._take_back(batch)
            failure = f"bind to node {node}: {exc}"
            _refuse(batch, "api" if isinstance(exc, KubeError) else "bad-annotation", lambda _r: failure)
        except BaseException:
            log.exception("binding %d pod(s) onto node %s failed", len(batch), node)
            self._take_back(batch)
            _refuse(batch, "internal", lambda r: f"bind {r.where}: internal error; see the extender's log")
            raise

    def _take_back(self, batch: list[_Bind]) -> None:
        """Undo the placements of ``batch`` that no swap recorded: they count in flight no more."""
        for request in batch:
            if request.placed is not None:
                self._cache.forget(request.uid)
                request.placed = None

    def _try_batch(self, batch: list[_Bind], node: str, fresh: bool) -> bool:
        """One attempt at the undecided binds of ``batch``; False when the node changed under it."""
        node_obj = self._node(node, fresh)
        if refusal := kubelet_refusal(node_obj):
            _refuse(batch, "kubelet-not-watching", lambda r: f"bind {r.where}: {refusal}")
            return True
        if refusal := self._cache.agent_problem(node):
            _refuse(batch, "node-agent-not-ready", lambda r: f"bind {r.where}: {refusal}")
            return True
        inventory = node_inventory(node_obj)
        listed = self._cache.pods_on(node)
        self._settle_bound(batch, node, node_obj, listed)
        pending = [r for r in batch if not r.decided]
        own = {r.uid for r in pending}
        ledger, cards, _ = self.node_cards(node_obj, inventory, own, listed, self._cache.requests_on(node))
        recorded: list[_Bind] = []
        text = ""
        for request in pending:
            try:
                if any(r.uid == request.uid for r in recorded):
                    BIND_FAILURES.labels(reason="bind-under-way").inc()
                    raise BindError(f"bind {request.where}: a bind of this pod is under way already")
                placed = self._place(request, node, node_obj, inventory, ledger, cards)
            except BindError as exc:
                request.error = exc
                if (entry := ledger.get(request.uid)) is not None:  # what it held stays held
                    cards = taking(cards, entry.held)
                continue
            held = held_units(placed.allocation, request.ask.request)
            meta = request.pod["metadata"]
            # at the annotation's precision, so that the entry read back compares equal to it
            entry = PendingBind(f"{meta['namespace']}/{meta['name']}", held, round(time.time(), 3))
            grown = {**ledger, request.uid: entry}
            grown_text = format_pending_binds(grown)
            if len(grown_text) > LEDGER_BYTES:
                BIND_FAILURES.labels(reason="ledger-full").inc()
                request.error = BindError(
                    f"bind {request.where}: node {node} annotation {NODE_ANN_PENDING_BINDS} would take "
                    f"{len(grown_text)} bytes with {len(grown)} entries, more than the {LEDGER_BYTES} allowed"
                )
                continue
            request.previous, request.entry = ledger.get(request.uid), entry
            ledger, text, cards = grown, grown_text, taking(cards, held)
            request.placed = placed
            self._cache.assume(request.uid, node, held)
            recorded.append(request)
        if not recorded:
            return True
        if self._swap(node, node_obj, text, recorded):
            return True
        self._take_back(recorded)
        return False

    def _settle_bound(
        self, batch: list[_Bind], node: str, node_obj: Mapping[str, Any], listed: Sequence[Mapping[str, Any]]
    ) -> None:
        """Decide the binds of ``batch`` whose pods are bound already, or have a bind under way in this
        replica, before anything is placed: they are neither placed again nor left out of what the node's
        cards hold. A pod the node's ``listed`` pods show is bound here; one in flight here, or with a bind
        entry (not a gang hold) in the node's ledger, costs a read, since the cache may not show its
        binding yet."""
        on_node = {(p.get("metadata") or {}).get("uid") for p in listed}
        busy = self._cache.assumed_uids()
        try:
            ledger: Ledger = node_ledger(node_obj)
        except ContractError:
            ledger = self._cache.trusted_ledger(node) or {}
        for request in batch:
            if request.decided:
                continue
            if request.uid in on_node:
                request.bound_here = True
                continue
            entry = ledger.get(request.uid)
            if request.uid not in busy and (entry is None or entry.gang):
                continue
            meta = request.pod["metadata"]
            try:
                pod = get_pod(self._api, meta["namespace"], meta["name"])
                if (pod.get("metadata") or {}).get("uid") != request.uid:
                    BIND_FAILURES.labels(reason="uid-mismatch").inc()
                    raise BindError(f"bind {request.where}: the pod was replaced (uid {quoted(request.uid)} is gone)")
                request.bound_here = self._bound_before(pod, node, request.where)
                if not request.bound_here and request.uid in busy:
                    BIND_FAILURES.labels(reason="bind-under-way").inc()
                    raise BindError(f"bind {request.where}: a bind of this pod is under way already")
            except KubeError as exc:
                BIND_FAILURES.labels(reason="pod-unreadable").inc()
                request.error = BindError(f"bind to node {node}: {exc}")
            except BindError as exc:
                request.error = exc

    def _place(
        self,
        request: _Bind,
        node: str,
        node_obj: Mapping[str, Any],
        inventory: NodeInventory,
        ledger: Ledger,
        cards: tuple[placement.CardCapacity, ...],
    ) -> _Placed:
        """The cards of one pod on ``cards`` (step 2), or BindError saying why not."""
        ask, where = request.ask, request.where
        if inventory.inferred is not None and (refusal := podfit.original_plugin_refusal(ask.demands)):
            BIND_FAILURES.labels(reason="original-plugin").inc()
            raise BindError(f"bind {where}: node {node} {refusal}")
        if refusal := node_refusal(ask.nodes, parse_node_facts(node_obj)):
            BIND_FAILURES.labels(reason="node-selector").inc()
            raise BindError(f"bind {where}: {refusal}")
        if (gang := ask.gang) is not None:
            hold = ledger.get(request.uid)
            if hold is None or hold.gang != gang.key:
                BIND_FAILURES.labels(reason="gang-not-held").inc()
                raise BindError(
                    f"bind {where}: gang {gang.name}: no cards are held for this member on the node; "
                    "it is bound only once a place is held for enough of its gang"
                )
            cards = within(cards, hold.held)
        try:
            _, policy = self._engine.policy_for(ask)
            assignments = ask.order.place(cards, policy, inventory.unit.name, ask.rule)
        except ContractError as exc:
            BIND_FAILURES.labels(reason="bad-annotation").inc()
            raise BindError(f"bind to node {node}: {exc}") from None
        except placement.NoFit as nofit:
            BIND_FAILURES.labels(reason="no-fit").inc()
            raise BindError(f"bind {where}: {nofit.reason}") from None
        allocation = allocation_of(assignments)
        return _Placed(allocation, pod_annotations(ask.request, allocation, inventory), inventory.unit)

    def _swap(self, node: str, node_obj: Mapping[str, Any], ledger_text: str, recorded: list[_Bind]) -> bool:
        """Step 3 of the module doc: ``ledger_text`` (the ledger with the entries of ``recorded``) on the
        node, if it is still as ``node_obj``; False when it changed. Any other failure refuses the binds."""
        try:
            written = self._write_ledger(node, node_obj, ledger_text)
        except KubeConflict:
            log.info("bind of %d pod(s) onto node %s: the node changed meanwhile; placing again", len(recorded), node)
            return False
        except KubeError as exc:
            self._take_back(recorded)
            failure = f"recording the bind on the node failed, assignment taken back: {exc}"
            _refuse(recorded, "api", lambda r: f"bind {r.where}: {failure}")
            return True
        self._cache.note_node(written)  # the next bind onto the node starts from this version
        return True

    def _write_ledger(self, node: str, node_obj: Mapping[str, Any], ledger_text: str) -> dict[str, Any]:
        """``ledger_text`` as the node's ledger, with the bind counter one up, if the node is still at
        ``node_obj``'s version (KubeConflict otherwise; ValueError for an unreadable counter)."""
        sequence = int(annotations_of(node_obj).get(NODE_ANN_BIND_SEQUENCE) or 0) + 1
        annotations = {NODE_ANN_BIND_SEQUENCE: str(sequence), NODE_ANN_PENDING_BINDS: ledger_text}
        return patch_node(
            self._api,
            node,
            {"metadata": {"annotations": annotations}},
            resource_version=(node_obj.get("metadata") or {}).get("resourceVersion"),
        )

    def _create_binding(self, request: _Bind, node: str) -> None:
        """Step 4 of the module doc. A binding that failed (409: the pod is bound already, by an earlier
        bind whose answer was lost or by anyone else) puts the ledger back as it was before this attempt;
        the pod bound to this node then answers success, otherwise the bind fails."""
        pod, placed, where = request.pod, request.placed, request.where
        assert placed is not None
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        try:
            bind_pod(self._api, namespace, name, uid, node, placed.annotations)
        except KubeError as exc:
            now = self._bound(namespace, name, uid, node, placed.annotations)
            if now is not True:
                self._cache.forget(uid)
                self._put_back(node, request)
                if now == node:
                    log.info("bind %s: the pod was bound to the node by an earlier bind; nothing changed", where)
                    return
                BIND_FAILURES.labels(reason="binding").inc()
                elsewhere = f"; the pod is bound to node {now}" if now else ""
                raise BindError(
                    f"bind {where}: creating the binding failed, assignment taken back: {exc}{elsewhere}"
                ) from None
            log.info("bind %s: the binding had been created before its answer was lost", where)
        cards = "; ".join(
            f"{c}: {', '.join(f'card {s.index} ({placed.unit.describe(s.units)})' for s in ss)}"
            for c, ss in placed.allocation.items()
        )
        log.info("bound pod %s/%s to node %s: %s", namespace, name, node, cards)
        self.events.record(pod, reason="GPUAssigned", message=f"node {node}: {cards}")

    def fresh_cards(
        self, node_obj: Mapping[str, Any], inventory: NodeInventory, own: set[str]
    ) -> tuple[dict[str, PendingBind], tuple[placement.CardCapacity, ...], set[str]]:
        """:meth:`node_cards` with the node's pods listed by the API server as of a version no older than
        ``node_obj``'s (a gang's hold is written without a binding after it, so the pods it is checked
        against are read fresh)."""
        node = node_obj["metadata"]["name"]
        node_version = (node_obj.get("metadata") or {}).get("resourceVersion")
        listed = list_pods(self._api, field_selector=f"spec.nodeName={node}", resource_version=node_version)
        return self.node_cards(node_obj, inventory, own, listed)

    def node_cards(
        self,
        node_obj: Mapping[str, Any],
        inventory: NodeInventory,
        own: set[str],
        listed: Sequence[Mapping[str, Any]],
        requests: Mapping[str, PodRequest | ContractError] | None = None,
    ) -> tuple[dict[str, PendingBind], tuple[placement.CardCapacity, ...], set[str]]:
        """The node's ledger entries that stay (see :meth:`_ledger`), its cards with every pod of ``listed``
        (the pods bound to it; ``requests``: their requests by pod key, as read already), in-flight bind and
        gang hold counted except those of the pods ``own``, and which of ``own`` ``listed`` shows bound to
        the node."""
        node = node_obj["metadata"]["name"]
        others = [p for p in listed if (p.get("metadata") or {}).get("uid") not in own]
        bound = {uid for p in listed if (uid := (p.get("metadata") or {}).get("uid")) in own}
        # a pod the fresh read shows placed is counted from its annotations, not again as in flight
        placed = {
            (p.get("metadata") or {}).get("uid")
            for p in others
            if any(key in annotations_of(p) for key in PLACEMENT_ANNOTATIONS)
        }
        assumed = self._cache.assumed_on(node)
        in_flight = [held for other, held in assumed if other not in placed | own]
        ledger, unlisted = self._ledger(node_obj, node, others)
        mine = {other for other, _ in assumed} | own
        in_flight += [entry.held for other, entry in unlisted.items() if other not in mine]
        cards = placement_cards(inventory, others, in_flight, self._cache.fenced(node), ledger, requests)
        return ledger, cards, bound

    def _ledger(
        self, node_obj: Mapping[str, Any], node: str, listed: Sequence[Mapping[str, Any]]
    ) -> tuple[dict[str, PendingBind], dict[str, PendingBind]]:
        """The node's ledger entries that stay, and those of them whose pods ``listed`` (the node's pods
        but the ones being placed) lacks: binds whose binding may still be under way and gang holds,
        counted in flight.

        An entry stays while its pod is listed and holds its cards, with no API call. An entry whose pod
        isn't listed stays while the pod (this uid) is still there, not bound elsewhere, and either bound
        here or unexpired (a binding may be under way, or a gang holds the cards); only these few cost a
        GET, except this replica's own binds in flight, which stay without one, and pods the cache saw
        deleted, which go without one."""
        try:
            ledger = node_ledger(node_obj)
        except ContractError as exc:
            trusted = self._cache.trusted_ledger(node)
            if trusted is None:
                raise LedgerError(
                    f"{exc}; no ledger of the node was read before to rebuild it from, so binds onto node {node} "
                    "are refused until it is repaired (see docs/operations.md)"
                ) from None
            log.error("%s; rebuilt from the %d entries last read, which this write puts back", exc, len(trusted))
            ledger = dict(trusted)
        uids = {(p.get("metadata") or {}).get("uid"): p for p in listed}
        binding = self._cache.assumed_uids()
        kept: dict[str, PendingBind] = {}
        unlisted: dict[str, PendingBind] = {}
        for uid, entry in ledger.items():
            if uid in uids:
                if holds_resources(uids[uid]):
                    kept[uid] = entry
                continue
            if uid in binding:  # this replica's own bind, not yet seen bound: in flight, no read needed
                kept[uid] = unlisted[uid] = entry
                continue
            if self._cache.gone(uid):  # seen deleted: it holds nothing, and no read is needed to know
                continue
            namespace, _, name = entry.pod.partition("/")
            try:
                pod = get_pod(self._api, namespace, name)
            except KubeNotFound:
                continue
            where = (pod.get("spec") or {}).get("nodeName")
            if (pod.get("metadata") or {}).get("uid") != uid or where not in (None, "", node):
                continue
            if where or time.time() < entry.expires():
                kept[uid] = unlisted[uid] = entry
        return kept, unlisted

    def _bound(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]
    ) -> bool | str | None:
        """True when the pod (this uid) is bound to ``node`` with ``annotations`` (whose assume time is
        this attempt's own) already; else the node it is bound to otherwise, or None (unbound, gone or
        unreadable)."""
        try:
            pod = get_pod(self._api, namespace, name)
        except KubeError:
            return None
        if (pod.get("metadata") or {}).get("uid") != uid:
            return None
        current = annotations_of(pod)
        bound_to = (pod.get("spec") or {}).get("nodeName") or None
        if bound_to == node and all(current.get(key) == value for key, value in annotations.items()):
            return True
        return bound_to

    def _put_back(self, node: str, request: _Bind) -> None:
        """Replace the ledger entry this attempt wrote for the pod with the one it had before (or none), by
        compare-and-swap under the node's lock; an entry someone changed since is left as it is."""
        uid, where = request.uid, request.where
        with self.node_lock(node):
            for _ in range(ATTEMPTS):
                try:
                    node_obj = get_node(self._api, node)
                    ledger = node_ledger(node_obj)
                    if ledger.get(uid) != request.entry:
                        return
                    rest = {other: e for other, e in ledger.items() if other != uid}
                    if request.previous is not None:
                        rest[uid] = request.previous
                    written = self._write_ledger(node, node_obj, format_pending_binds(rest))
                except KubeConflict:
                    continue
                except (KubeError, ValueError) as exc:  # ValueError: an unreadable ledger or bind counter
                    log.warning("bind %s: putting the pod's ledger entry back failed: %s", where, exc)
                    return
                self._cache.note_node(written)
                log.info("bind %s: the binding failed, the pod's ledger entry is as before", where)
                return
        log.warning("bind %s: putting the pod's ledger entry back failed: the node kept changing", where)
