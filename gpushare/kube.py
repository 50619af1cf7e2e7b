"""Kubernetes access through the official client: configuration, watch caches and retrying writes.

Objects are handled as the plain JSON dicts the API returns (``_preload_content=False``), which is
several times faster than the client's model classes and keeps unknown fields intact. Every failure
is mapped to a :class:`KubeError` subclass whose message names the object.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)

#: (connect, read) seconds for ordinary calls: an outage must show within seconds, not minutes
REQUEST_TIMEOUT = (2.0, 10.0)
WATCH_SECONDS = 240


class KubeError(Exception):
    """An API call failed; the message names the object."""


class KubeConfigError(KubeError):
    """No usable kubeconfig or in-cluster configuration."""


class KubeUnavailable(KubeError):
    """The API server can't be reached or answers 5xx."""


class KubeConflict(KubeError):
    """409: a precondition failed or the object changed underneath us."""


class KubeNotFound(KubeError):
    """404."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential back-off with jitter, in seconds."""

    initial: float = 0.2
    maximum: float = 10.0
    factor: float = 2.0
    jitter: float = 0.2

    def delays(self) -> Iterator[float]:
        delay = self.initial
        while True:
            yield delay * (1 + random.uniform(-self.jitter, self.jitter))
            delay = min(self.maximum, delay * self.factor)


def load_api(kubeconfig: str | None) -> client.ApiClient:
    """``kubeconfig`` when given; otherwise in-cluster configuration, then ``~/.kube/config``."""
    if kubeconfig:
        try:
            return config.new_client_from_config(config_file=kubeconfig)
        except (config.ConfigException, OSError, ValueError) as exc:
            raise KubeConfigError(f"kubeconfig {kubeconfig}: {exc}") from None
    try:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except config.ConfigException:
        pass
    try:
        return config.new_client_from_config()
    except (config.ConfigException, OSError, ValueError) as exc:
        raise KubeConfigError(f"no in-cluster configuration and no usable ~/.kube/config ({exc})") from None


def _translate(exc: Exception, what: str) -> KubeError:
    if isinstance(exc, ApiException):
        detail = exc.reason
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            detail = json.loads(exc.body).get("message", detail)
        if exc.status == 409:
            return KubeConflict(f"{what}: conflict: {detail}")
        if exc.status == 404:
            return KubeNotFound(f"{what}: not found")
        if exc.status is None or exc.status >= 500 or exc.status == 429:
            return KubeUnavailable(f"{what}: API server answered {exc.status}: {detail}")
        return KubeError(f"{what}: API server answered {exc.status}: {detail}")
    return KubeUnavailable(f"{what}: API server unreachable ({type(exc).__name__}: {exc})")


_TRANSPORT_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)


def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one API call returning parsed JSON, with errors translated."""
    kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
    try:
        reply = fn(*args, _preload_content=False, **kwargs)
        return json.loads(reply.data) if reply.data else {}
    except _TRANSPORT_ERRORS as exc:
        raise _translate(exc, what) from None


def _retrying(what: str, attempt: Callable[[], Any], retries: int, backoff: Backoff, retry_conflicts: bool) -> Any:
    delays = backoff.delays()
    for remaining in range(retries, -1, -1):
        try:
            return attempt()
        except KubeConflict:
            if not retry_conflicts or remaining == 0:
                raise
            delay = next(delays)
            log.info("%s: conflict, retrying in %.2fs", what, delay)
        except KubeUnavailable as exc:
            if remaining == 0:
                raise
            delay = next(delays)
            log.warning("%s: %s; retrying in %.2fs", what, exc, delay)
        threading.Event().wait(delay)
    raise AssertionError("unreachable")


def list_pods(
    api: client.ApiClient,
    *,
    field_selector: str | None = None,
    label_selector: str | None = None,
    resource_version: str | None = None,
) -> list[dict[str, Any]]:
    """With ``resource_version`` (non-zero) the API server answers from its watch cache, once that cache
    is at least that recent, instead of reading every pod from etcd."""
    kwargs = {
        k: v
        for k, v in (
            ("field_selector", field_selector),
            ("label_selector", label_selector),
            ("resource_version", resource_version),
        )
        if v
    }
    return _call("list pods", client.CoreV1Api(api).list_pod_for_all_namespaces, **kwargs).get("items") or []


def list_nodes(api: client.ApiClient) -> list[dict[str, Any]]:
    return _call("list nodes", client.CoreV1Api(api).list_node).get("items") or []


def get_pod(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return _call(f"pod {namespace}/{name}", client.CoreV1Api(api).read_namespaced_pod, name, namespace)


def get_node(api: client.ApiClient, name: str) -> dict[str, Any]:
    return _call(f"node {name}", client.CoreV1Api(api).read_node, name)


MERGE_PATCH = "application/merge-patch+json"


def _with_precondition(patch: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
    if resource_version is None:
        return patch
    meta = {**(patch.get("metadata") or {}), "resourceVersion": resource_version}
    return {**patch, "metadata": meta}


def _merge_patch(
    what: str,
    send: Callable[..., Any],
    patch: dict[str, Any],
    resource_version: str | None,
    retries: int,
    backoff: Backoff,
) -> dict[str, Any]:
    """With ``resource_version`` the patch only applies to that version (a stale one raises
    :class:`KubeConflict` at once); without it conflicts and outages are retried."""
    body = _with_precondition(patch, resource_version)
    return _retrying(
        what,
        lambda: _call(what, send, body=body, _content_type=MERGE_PATCH),
        retries,
        backoff,
        retry_conflicts=resource_version is None,
    )


def patch_pod(
    api: client.ApiClient,
    namespace: str,
    name: str,
    patch: dict[str, Any],
    *,
    resource_version: str | None = None,
    retries: int = 5,
    backoff: Backoff = Backoff(),
) -> dict[str, Any]:
    """JSON-merge-patch a pod (see :func:`_merge_patch` for preconditions and retries)."""
    send = functools.partial(client.CoreV1Api(api).patch_namespaced_pod, name, namespace)
    return _merge_patch(f"pod {namespace}/{name}", send, patch, resource_version, retries, backoff)


def patch_pod_status(api: client.ApiClient, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    """Merge-patch the pod's status subresource (what kubelet reports)."""
    send = functools.partial(client.CoreV1Api(api).patch_namespaced_pod_status, name, namespace)
    return _merge_patch(f"pod {namespace}/{name} status", send, {"status": status}, None, 5, Backoff())


def patch_pod_annotations(
    api: client.ApiClient, namespace: str, name: str, annotations: dict[str, str | None], **kwargs: Any
) -> dict[str, Any]:
    """Set annotations; a value of None removes the key."""
    return patch_pod(api, namespace, name, {"metadata": {"annotations": annotations}}, **kwargs)


def patch_node(
    api: client.ApiClient,
    name: str,
    patch: dict[str, Any],
    *,
    resource_version: str | None = None,
    retries: int = 5,
    backoff: Backoff = Backoff(),
) -> dict[str, Any]:
    """JSON-merge-patch a node (see :func:`_merge_patch` for preconditions and retries)."""
    send = functools.partial(client.CoreV1Api(api).patch_node, name)
    return _merge_patch(f"node {name}", send, patch, resource_version, retries, backoff)


def bind_pod(
    api: client.ApiClient,
    namespace: str,
    name: str,
    uid: str | None,
    node: str,
    annotations: dict[str, str] | None = None,
) -> None:
    """Bind the pod to ``node``; the API server also sets ``annotations`` on the pod, in the same write."""
    body = client.V1Binding(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace, uid=uid, annotations=annotations),
        target=client.V1ObjectReference(kind="Node", name=node, api_version="v1"),
    )
    _call(
        f"binding of pod {namespace}/{name} to node {node}",
        client.CoreV1Api(api).create_namespaced_pod_binding,
        name,
        namespace,
        body,
    )


def create_event(
    api: client.ApiClient, obj: dict[str, Any], *, reason: str, message: str, type_: str = "Normal", component: str
) -> None:
    """Record a Kubernetes Event about ``obj``. Best effort: an event must never break a decision."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "metadata": {"generateName": f"{meta.get('name', 'object')}.", "namespace": namespace},
        "involvedObject": {
            "kind": obj.get("kind") or "Pod",
            "apiVersion": "v1",
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "reason": reason,
        "message": message,
        "type": type_,
        "source": {"component": component},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        _call(
            f"event for {namespace}/{meta.get('name')}", client.CoreV1Api(api).create_namespaced_event, namespace, event
        )
    except KubeError as exc:
        log.warning("could not record event %s on %s/%s: %s", reason, namespace, meta.get("name"), exc)


class BackgroundEvents:
    """Records Events from one background thread, as client-go's recorder does: the caller never waits
    for the API server, and Events keep the order they were recorded in."""

    def __init__(self, api: client.ApiClient, component: str) -> None:
        self._api = api
        self._component = component
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{component}-events")

    def record(self, obj: dict[str, Any], *, reason: str, message: str, type_: str = "Normal") -> None:
        self._pool.submit(
            create_event, self._api, obj, reason=reason, message=message, type_=type_, component=self._component
        )

    def close(self) -> None:
        """Record what is queued, then stop."""
        self._pool.shutdown(wait=True)


def _name_key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def _rv(obj: dict[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


class WatchCache:
    """An in-memory mirror of pods, nodes or one namespace's ConfigMaps, kept by LIST then WATCH,
    re-listing after 410 Gone and reconnecting with back-off after an outage. ``connected`` tells
    whether it is currently live."""

    def __init__(
        self,
        api: client.ApiClient,
        kind: Literal["pods", "nodes", "configmaps"],
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
        self._thread: threading.Thread | None = None
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
        return self._connected

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

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"watch-{self._kind}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # Closing the response from here would block on the reader's lock; shutting the socket down
        # makes the blocked read return at once instead.
        sock = getattr(getattr(self._response, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

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
                if current is not None and _rv(current) > _rv(obj):
                    return  # we already hold a newer version (our own write)
                self._objects[key] = obj
        for listener in self._listeners:
            try:
                listener(type_, obj)
            except Exception:
                log.exception("watch listener failed on %s %s/%s", self._kind, *key)

    def _list_fn(self) -> Callable[..., Any]:
        core = client.CoreV1Api(self._api)
        if self._kind == "configmaps":
            return functools.partial(core.list_namespaced_config_map, self._namespace)
        return core.list_pod_for_all_namespaces if self._kind == "pods" else core.list_node

    def _relist(self) -> int:
        reply = _call(f"list {self.description}", self._list_fn(), **self._selectors)
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
                self._connected = False
                rv = None  # a fresh LIST after an outage catches every change we missed
                self._stop.wait(next(delays))


def node_pod_cache(api: client.ApiClient, node_name: str) -> WatchCache:
    """Pods bound to one node: what a node component needs, and nothing it doesn't."""
    return WatchCache(api, "pods", field_selector=f"spec.nodeName={node_name}")
