"""Pods refused for want of room, marked for a retry when room may have come free.

When a bound pod ends or goes, kube-scheduler retries the Pending pods an extender refused (an extender's
refusal makes any cluster event count, kubernetes#122019), but it may do so before this extender's cache
has applied the same event: both follow the API server, each at its own pace. The filter then refuses
again on the stale count, and kube-scheduler's next retry without an event is its flush of pods that have
been unschedulable for 5 minutes (60 s in 1.20, which hid this). So the extender remembers each pod it
refused for want of room and the nodes it refused, and once its own cache has applied a bound pod ending
or going on one of those nodes it changes an annotation on the waiting pod: a change to the pod itself
is an event for that pod, and kube-scheduler retries it at once, now against a cache that has the room.
A node that could take no GPU pod at all (no kubelet watching its device plugin, no inventory, a damaged
ledger) and now can is the same kind of event. A filter that began before such an event, and refused,
marks its pod at once, since it may have missed it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpushare.holdings.pod import holds_resources
from gpushare.kube.errors import KubeError
from gpushare.kube.objects import patch_pod_annotations

if TYPE_CHECKING:
    from gpushare.extender.cache import ClusterCache

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Waiter:
    """A pod refused for want of room: the annotation that marks it, and the nodes whose room it waits
    for (None: any node)."""

    namespace: str
    name: str
    annotation: str
    nodes: frozenset[str] | None


class RoomWaiters:
    """The pods waiting for room, each under a key (a pod's uid, or a gang's key for the member that
    speaks for its gang); marked one at a time by a thread of its own, so no pod event waits on a patch."""

    def __init__(self, api: Any, cache: ClusterCache) -> None:
        self._api = api
        self._cache = cache
        self._lock = threading.Lock()
        self._waiting: dict[str, Waiter] = {}
        #: nodes last seen unable to take any GPU pod
        self._troubled: set[str] = set()
        #: times room may have come free (a bound pod ending or going, a node able to take GPU pods again),
        #: so a refusal can tell whether it missed one
        self._freed = 0
        self._marks: queue.SimpleQueue[Waiter | None] = queue.SimpleQueue()
        self._marker = threading.Thread(target=self._mark_loop, name="room-retry", daemon=True)
        self._marker.start()
        cache.pods.add_listener(self._on_pod)
        cache.nodes.add_listener(self._on_node)

    def close(self) -> None:
        self._marks.put(None)
        self._marker.join(timeout=5)

    def seen(self) -> int:
        """How many times room may have come free so far: a filter takes this before it decides, for
        :meth:`wait`."""
        with self._lock:
            return self._freed

    def wait(self, key: str, waiter: Waiter, seen: int) -> None:
        """Remember that ``waiter`` waits for room; if room may have come free since ``seen`` (:meth:`seen`
        when its filter began), the refusal may have missed it: mark the pod at once."""
        with self._lock:
            missed = self._freed != seen
            if not missed:
                self._waiting[key] = waiter
        if missed:
            self._marks.put(waiter)

    def forget(self, key: str) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def _on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        """Called after the cache has applied the event, so the retry a mark causes sees the room."""
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        node = spec.get("nodeName")
        if node or kind == "DELETED":
            with self._lock:
                self._waiting.pop(meta.get("uid", ""), None)  # bound or gone: it waits no more
        if node and (kind == "DELETED" or not holds_resources(pod)):
            self._room_on(node)

    def _on_node(self, kind: str, node: Mapping[str, Any]) -> None:
        """A node that could take no GPU pod and now can: room on it. After the cache applied the event."""
        name = (node.get("metadata") or {}).get("name", "")
        troubled = kind != "DELETED" and self._cache.problem(name) is not None
        with self._lock:
            recovered = name in self._troubled and not troubled
            if troubled:
                self._troubled.add(name)
            else:
                self._troubled.discard(name)
        if recovered and kind != "DELETED":
            self._room_on(name)

    def _room_on(self, node: str) -> None:
        with self._lock:
            self._freed += 1
            due = [key for key, w in self._waiting.items() if w.nodes is None or node in w.nodes]
            marked = [self._waiting.pop(key) for key in due]
        for waiter in marked:
            self._marks.put(waiter)

    def _mark_loop(self) -> None:
        while (waiter := self._marks.get()) is not None:
            try:
                patch_pod_annotations(
                    self._api, waiter.namespace, waiter.name, {waiter.annotation: f"{time.time():.3f}"}
                )
            except KubeError as exc:
                log.warning("pod %s/%s: marking it for a retry failed: %s", waiter.namespace, waiter.name, exc)
                continue
            log.info("pod %s/%s: room may have come free, marked for a retry (%s)", waiter.namespace, waiter.name,
                     waiter.annotation)  # fmt: skip
