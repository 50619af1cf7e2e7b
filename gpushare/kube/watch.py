"""An in-memory mirror of Kubernetes objects, kept by LIST then WATCH."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any, Literal

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from gpushare.kube.errors import KubeUnavailable
from gpushare.kube.retry import Backoff
from gpushare.kube.transport import REQUEST_TIMEOUT, call, report_unreachable
from gpushare.restartable import RestartableThread

log = logging.getLogger(__name__)

WATCH_SECONDS = 240


def _name_key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def _rv(obj: dict[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


class WatchCache:
    """An in-memory mirror of pods, nodes, ResourceSlices, ResourceClaims or one namespace's ConfigMaps,
    kept by LIST then WATCH, re-listing after 410 Gone and reconnecting with back-off after an outage.
    ``connected`` tells whether it is currently live."""

    def __init__(
        self,
        api: client.ApiClient,
        kind: Literal["pods", "nodes", "configmaps", "resourceslices", "resourceclaims"],
        *,
        namespace: str | None = None,
        field_selector: str | None = None,
        label_selector: str | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self._api = api
        self._kind = kind
        self._namespace = namespace
        self._selectors = {
            k: v for k, v in (("field_selector", field_selector), ("label_selector", label_selector)) if v
        }
        self._backoff = backoff or Backoff(initial=0.1, maximum=2.0)
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._synced = threading.Event()
        self._connected = False
        self._stop = threading.Event()
        self._follower = RestartableThread(self._run, f"watch-{kind}")
        self._response: Any = None
        self.description = f"{kind}" + (f" ({', '.join(self._selectors.values())})" if self._selectors else "")

    # --- reading ----------------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float | None) -> bool:
        return self._synced.wait(timeout)

    @property
    def connected(self) -> bool:
        """Following the API server now (never while the cache is stopped, or after its thread died)."""
        return self._connected and self.alive()

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._objects.values())

    def get(self, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get((namespace or "", name))

    def add_listener(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        self._listeners.append(fn)

    def apply(self, obj: dict[str, Any]) -> None:
        """Record an object we just wrote, so our next read sees it even before the watch does."""
        self._store("MODIFIED", obj)

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> WatchCache:
        """Follow the API server, from a LIST. After :meth:`stop`, or after the thread died, follow it again,
        keeping the objects held (the LIST settles what changed meanwhile) and the listeners. A no-op while
        it runs."""
        if not self._follower.alive():
            self._stop.clear()
            self._connected = False
            self._follower.start()
        return self

    def alive(self) -> bool:
        return self._follower.alive()

    def stop(self) -> None:
        self._stop.set()
        # Closing the response from here would block on the reader's lock; shutting the socket down
        # makes the blocked read return at once instead.
        sock = getattr(getattr(self._response, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._follower.join(timeout=5)

    # --- internals --------------------------------------------------------------------------------------

    def _store(self, type_: str, obj: dict[str, Any]) -> None:
        key = _name_key(obj)
        with self._lock:
            current = self._objects.get(key)
            if type_ == "DELETED":
                if current is not None and _rv(current) > _rv(obj):
                    return
                self._objects.pop(key, None)
            else:
                if current is not None and _rv(current) >= _rv(obj) > 0:
                    return  # we already hold this version or a newer one (our own write)
                self._objects[key] = obj
        for listener in self._listeners:
            try:
                listener(type_, obj)
            except Exception:
                log.exception("watch listener failed on %s %s/%s", self._kind, *key)

    def _list_fn(self) -> Callable[..., Any]:
        if self._kind == "resourceslices":
            return client.ResourceV1Api(self._api).list_resource_slice
        if self._kind == "resourceclaims":
            return client.ResourceV1Api(self._api).list_resource_claim_for_all_namespaces
        core = client.CoreV1Api(self._api)
        if self._kind == "configmaps":
            return functools.partial(core.list_namespaced_config_map, self._namespace)
        return core.list_pod_for_all_namespaces if self._kind == "pods" else core.list_node

    def _relist(self) -> int:
        reply = call(f"list {self.description}", self._list_fn(), **self._selectors)
        fresh = {_name_key(o): o for o in reply.get("items") or []}
        with self._lock:
            held = dict(self._objects)
        for key, obj in held.items():
            if key not in fresh:
                self._store("DELETED", obj)
        for key, obj in fresh.items():
            if key not in held:
                self._store("ADDED", obj)
            elif _rv(obj) != _rv(held[key]):
                self._store("MODIFIED", obj)
        return int(reply.get("metadata", {}).get("resourceVersion") or 0)

    def _watch(self, rv: int) -> int | None:
        """Follow the watch from ``rv``; the last version seen, or None when it expired (410)."""
        self._response = self._list_fn()(
            watch=True,
            resource_version=str(rv),
            timeout_seconds=WATCH_SECONDS,
            allow_watch_bookmarks=True,
            _preload_content=False,
            _request_timeout=(REQUEST_TIMEOUT[0], WATCH_SECONDS + 30),
            **self._selectors,
        )
        if self._stop.is_set():  # stop() ran while the watch was being opened
            self._response.close()
        try:
            for line in iter_resp_lines(self._response):
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") == 410:
                        return None
                    raise KubeUnavailable(f"watch {self.description}: {obj.get('message')}")
                rv = max(rv, _rv(obj))
                if event.get("type") != "BOOKMARK":
                    self._store(event["type"], obj)
        finally:
            self._response.release_conn()
            self._response = None
        return rv

    def _run(self) -> None:
        delays = self._backoff.delays()
        rv: int | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                    if not self._synced.is_set():
                        log.info("watch cache of %s synced (%d objects)", self.description, len(self._objects))
                    self._synced.set()
                if not self._connected:
                    log.info("watch cache of %s connected", self.description)
                self._connected = True
                delays = self._backoff.delays()
                rv = self._watch(rv)
                if rv is None:
                    log.info("watch of %s expired; listing again", self.description)
            except Exception as exc:  # the loop must survive anything the transport throws
                if self._stop.is_set():
                    break
                if self._connected:
                    log.warning("watch cache of %s lost the API server: %s", self.description, exc)
                else:
                    report_unreachable(self._api, exc)
                self._connected = False
                rv = None  # a fresh LIST after an outage catches every change we missed
                self._stop.wait(next(delays))


def node_pod_cache(api: client.ApiClient, node_name: str) -> WatchCache:
    """Pods bound to one node: what a node component needs, and nothing it doesn't."""
    return WatchCache(api, "pods", field_selector=f"spec.nodeName={node_name}")
