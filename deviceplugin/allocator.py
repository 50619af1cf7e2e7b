"""The stateful side of Allocate: read the node's pods, decide, record the decision on the pod.

Allocate calls are serialised: the decision for one container must be recorded (and visible in the
cache) before the next call is matched, or two equal requests could claim the same container.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from deviceplugin.allocate import Decision, Refusal, decide, describe, preferred_cards
from deviceplugin.metrics import ALLOCATE_FAILURES, ALLOCATE_LATENCY, publish_card_usage
from gpushare.cards import Card
from gpushare.contract import MemoryUnit
from gpushare.kube import KubeError, KubeUnavailable, WatchCache, create_event, list_pods, patch_pod
from gpushare.usage import node_usage

log = logging.getLogger(__name__)
COMPONENT = "gpushare-device-plugin"
REFUSAL_EVENT_REASON = "GPUAllocationRefused"


class Unavailable(Exception):
    """The API server can't be reached: kubelet should retry later."""


class Allocator:
    def __init__(
        self,
        api: Any,
        node: str,
        cache: WatchCache,
        cards: Callable[[], Sequence[Card]],
        unit: MemoryUnit,
    ) -> None:
        self._api = api
        self._node = node
        self._cache = cache
        self._cards = cards
        self._unit = unit
        self._lock = threading.Lock()

    def pods(self) -> list[Mapping[str, Any]]:
        """The node's pods: from the watch cache; a LIST only while the cache has never synced."""
        if self._cache.synced:
            if not self._cache.connected:
                raise Unavailable(
                    f"the API server is unreachable from node {self._node}; pod assignments can't be read"
                )
            return self._cache.items()
        try:
            return list_pods(self._api, field_selector=f"spec.nodeName={self._node}")
        except KubeError as exc:
            raise Unavailable(f"node {self._node}: listing pods failed: {exc}") from None

    def allocate(self, resource: str, units: int) -> Decision:
        started = time.perf_counter()
        with self._lock:
            try:
                decision = self._allocate(resource, units)
            except Refusal as refusal:
                ALLOCATE_FAILURES.labels(resource=resource, reason=refusal.reason).inc()
                log.warning("node %s: refused %s x%d: %s", self._node, resource, units, refusal)
                if refusal.pod is not None:
                    create_event(
                        self._api,
                        dict(refusal.pod),
                        reason=REFUSAL_EVENT_REASON,
                        message=str(refusal),
                        type_="Warning",
                        component=COMPONENT,
                    )
                raise
            except Unavailable as exc:
                ALLOCATE_FAILURES.labels(resource=resource, reason="api-unavailable").inc()
                log.warning("node %s: %s x%d unavailable: %s", self._node, resource, units, exc)
                raise
        for skipped in decision.skipped:
            log.warning("node %s: passed over in Allocate: %s", self._node, skipped.reason)
            create_event(
                self._api,
                dict(skipped.pod),
                reason=REFUSAL_EVENT_REASON,
                message=f"passed over in Allocate on node {self._node}: {skipped.reason}",
                type_="Warning",
                component=COMPONENT,
            )
        ALLOCATE_LATENCY.labels(resource=resource).observe(time.perf_counter() - started)
        return decision

    def _allocate(self, resource: str, units: int) -> Decision:
        pods = self.pods()
        cards = self._cards()
        decision = decide(pods, self._node, resource, units, cards, self._unit)
        meta = decision.pod.get("metadata") or {}
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        where = f"pod {namespace}/{name} container {decision.container}"
        try:
            updated = patch_pod(self._api, namespace, name, decision.pod_patch, retries=2)
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
        self._cache.apply(updated)
        log.info(
            "node %s: pod %s container %s gets %s (%s x%d)",
            self._node,
            f"{namespace}/{name}",
            decision.container,
            describe(decision.slices),
            resource,
            units,
        )
        publish_card_usage(self._node, cards, decision.usage, self._unit)
        return decision

    def preferred(self, resource: str, size: int) -> tuple[str, ...]:
        with self._lock:
            try:
                pods = self.pods()
            except Unavailable:
                return ()
            return preferred_cards(pods, self._node, resource, size, self._cards())

    def publish_usage(self) -> None:
        try:
            pods = self.pods()
        except Unavailable:
            return
        cards = self._cards()
        used, _, _ = node_usage(pods, cards)
        publish_card_usage(self._node, cards, used, self._unit)
