"""The stateful side of Allocate: read the node's pods, decide, record the decision on the pod.

Allocate calls are serialised: the decision for one container must be recorded (and visible in the
cache) before the next call is matched, or two equal requests could claim the same container.

The node's pods come from a watch cache, which can be behind kubelet's own view: kubelet may call
Allocate for a pod the cache hasn't seen yet, or while it still holds a pod that is gone. A refusal
that depends on which pods are on the node is therefore only given after re-reading them from the
API server (bounded by :class:`gpushare.settings.Reread`); the decision itself stays pure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpushare.deviceplugin.decision import Decision, booked_cards_note, decide, node_env, preferred_cards
from gpushare.deviceplugin.metrics import ALLOCATE_FAILURES, ALLOCATE_LATENCY, publish_card_usage

from gpushare.assignment import Refusal, describe
from gpushare.cards import Card
from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import ENV_CGPU_DISABLE
from gpushare.contract.pending import Ledger
from gpushare.contract.request import pod_key
from gpushare.contract.units import MemoryUnit
from gpushare.holdings.node import node_ledger, node_usage
from gpushare.kube.errors import KubeError, KubeUnavailable
from gpushare.kube.events import EventSource
from gpushare.kube.objects import get_node, list_pods, patch_pod
from gpushare.kube.watch import WatchCache
from gpushare.placement.demand import ANY_CARD, CardRule
from gpushare.settings import DEFAULT_REREAD, Reread

log = logging.getLogger(__name__)
REFUSAL_EVENT_REASON = "GPUAllocationRefused"
#: refusals a stale cache can cause: no pod matched, or a card looked full of pods that may be gone
STALE_CACHE_REASONS = frozenset({"no-pending-pod", "overcommit"})


class Unavailable(Exception):
    """The API server can't be reached: kubelet should retry later."""


@dataclass(eq=False)
class Allocator:
    """Allocate and GetPreferredAllocation for ``node``, serialised (see the module docstring)."""

    api: Any
    node: str
    cache: WatchCache
    cards: Callable[[], Sequence[Card]]
    unit: MemoryUnit
    events: EventSource
    reread: Reread = DEFAULT_REREAD
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    #: the node's labels and ledger as last read (read again on every Allocate)
    _labels: Mapping[str, str] = field(default_factory=dict, init=False, repr=False)
    _ledger: Ledger = field(default_factory=dict, init=False, repr=False)

    def pods(self) -> list[Mapping[str, Any]]:
        """The node's pods: from the watch cache; a LIST only while the cache has never synced."""
        if self.cache.synced:
            if not self.cache.connected:
                raise Unavailable(f"the API server is unreachable from node {self.node}; pod assignments can't be read")
            return self.cache.items()
        try:
            return list_pods(self.api, field_selector=f"spec.nodeName={self.node}")
        except KubeError as exc:
            raise Unavailable(f"node {self.node}: listing pods failed: {exc}") from None

    def allocate(self, resource: str, device_ids: Sequence[str]) -> Decision:
        """Serve one container's Allocate: ``device_ids`` are the devices kubelet booked for it."""
        started = time.perf_counter()
        units = len(device_ids)
        with self._lock:
            try:
                decision = self._allocate(resource, units)
            except Refusal as refusal:
                ALLOCATE_FAILURES.labels(resource=resource, reason=refusal.reason).inc()
                log.warning("node %s: refused %s x%d: %s", self.node, resource, units, refusal)
                if refusal.pod is not None:
                    self._warn(refusal.pod, str(refusal))
                raise
            except Unavailable as exc:
                ALLOCATE_FAILURES.labels(resource=resource, reason="api-unavailable").inc()
                log.warning("node %s: %s x%d unavailable: %s", self.node, resource, units, exc)
                raise
        for skipped in decision.skipped:
            log.warning("node %s: passed over in Allocate: %s", self.node, skipped.reason)
            self._warn(skipped.pod, f"passed over in Allocate on node {self.node}: {skipped.reason}")
        ALLOCATE_LATENCY.labels(resource=resource).observe(time.perf_counter() - started)
        note = booked_cards_note(resource, device_ids, decision.slices)
        if note:
            log.warning("node %s: pod %s container %s: %s", self.node, pod_key(decision.pod), decision.container, note)
        return decision

    def _warn(self, pod: Mapping[str, Any], message: str) -> None:
        """A Warning Event on ``pod`` about its Allocate (queued: Allocate never waits for it)."""
        self.events.record(pod, reason=REFUSAL_EVENT_REASON, message=message, type_="Warning")

    def _fresh_pods(self) -> list[Mapping[str, Any]]:
        """The node's pods as the API server has them now; the cache learns them too."""
        try:
            pods = list_pods(self.api, field_selector=f"spec.nodeName={self.node}")
        except KubeError as exc:
            raise Unavailable(f"node {self.node}: re-reading the node's pods failed: {exc}") from None
        for pod in pods:
            self.cache.apply(pod)
        return pods

    def _decide(self, resource: str, units: int, cards: Sequence[Card]) -> Decision:
        """Decide on the cached pods; on a refusal a stale cache could explain, decide again on pods
        re-read from the API server, a bounded number of times, before refusing."""
        try:
            return decide(self.pods(), self.node, resource, units, cards, self.unit, self._ledger)
        except Refusal as refusal:
            if refusal.reason not in STALE_CACHE_REASONS or not self.reread.attempts:
                raise
            last = refusal
        started = time.monotonic()
        for wait in self.reread.waits():
            if wait:
                time.sleep(wait)
            try:
                decision = decide(self._fresh_pods(), self.node, resource, units, cards, self.unit, self._ledger)
            except Refusal as refusal:
                if refusal.reason not in STALE_CACHE_REASONS:
                    raise
                last = refusal
                continue
            log.info(
                "node %s: %s x%d matched only after re-reading the node's pods (the watch cache lagged)",
                self.node,
                resource,
                units,
            )
            return decision
        raise Refusal(
            last.reason,
            f"{last} (the node's pods were re-read from the API server {self.reread.attempts} time(s) "
            f"over {time.monotonic() - started:.1f}s)",
            invalid_input=last.invalid_input,
            pod=last.pod,
        )

    def _read_node(self) -> None:
        """The node's labels and ledger now; the last ones read when the API server can't say."""
        try:
            node = get_node(self.api, self.node)
        except KubeError as exc:
            log.warning(
                "node %s: reading the node failed, using its labels and ledger as last read: %s", self.node, exc
            )
            return
        self._labels = (node.get("metadata") or {}).get("labels") or {}
        try:
            self._ledger = node_ledger(node)
        except ContractError as exc:
            log.error("%s; pods are checked against the ledger last read (%d entries)", exc, len(self._ledger))

    def _allocate(self, resource: str, units: int) -> Decision:
        cards = self.cards()
        self._read_node()
        decision = self._decide(resource, units, cards)
        if extra := node_env(self._labels):
            decision = replace(decision, envs={**decision.envs, **extra})
        meta = decision.pod.get("metadata") or {}
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        where = f"pod {namespace}/{name} container {decision.container}"
        try:
            updated = patch_pod(self.api, namespace, name, decision.pod_patch, retries=2)
        except KubeUnavailable as exc:
            raise Unavailable(
                f"{where}: recording the assignment of {describe(decision.slices)} failed: {exc}"
            ) from None
        except KubeError as exc:
            raise Refusal(
                "patch-failed",
                f"{where}: recording the assignment of {describe(decision.slices)} failed: {exc}",
                pod=decision.pod,
            ) from None
        self.cache.apply(updated)
        log.info(
            "node %s: pod %s container %s gets %s (%s x%d)%s",
            self.node,
            f"{namespace}/{name}",
            decision.container,
            describe(decision.slices),
            resource,
            units,
            "".join(f", {key}={value}" for key, value in sorted(decision.envs.items()) if key == ENV_CGPU_DISABLE),
        )
        publish_card_usage(self.node, cards, decision.usage, self.unit)
        return decision

    def preferred(self, resource: str, size: int) -> tuple[tuple[str, ...], CardRule]:
        """See :func:`preferred_cards`."""
        with self._lock:
            try:
                pods = self.pods()
            except Unavailable:
                return (), ANY_CARD
            return preferred_cards(pods, self.node, resource, size, self.cards())

    def publish_usage(self) -> None:
        try:
            pods = self.pods()
        except Unavailable:
            return
        cards = self.cards()
        used, _, _ = node_usage(pods, NodeInventory(self.unit, tuple(cards)), ledger=self._ledger)
        publish_card_usage(self.node, cards, used, self.unit)
