"""A minimal Kubernetes API server: the subset of the core/v1 REST API this project uses.

It serves pods (with the ``status`` and ``binding`` subresources), nodes (with ``status``), events and ConfigMaps
over plain HTTP on loopback, with resourceVersions, 409 conflicts, 404/422 Status replies, field and
label selectors and resumable watches, so that the official ``kubernetes`` client works against it
unchanged. The sandbox and the test-suite run on it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import yaml

from gpushare.sandbox.binaries import KUBE_VERSION
from gpushare.sandbox.patching import APPLY, SUPPORTED, PatchError, UndecodablePatch, apply_patch
from gpushare.sandbox.selectors import Predicate, SelectorError, parse_field_selector, parse_label_selector
from gpushare.sandbox.store import INDEXED, Event, Key, Store, StoreError, invalid

log = logging.getLogger(__name__)

KINDS = {"pods": "Pod", "nodes": "Node", "events": "Event", "configmaps": "ConfigMap"}
NAMESPACED = {"pods", "events", "configmaps"}
#: how often the accept loop looks for a stop request; bounds how long stop() and pause() take
POLL_SECONDS = 0.05
#: a pod's terminationGracePeriodSeconds when its spec has none
DEFAULT_GRACE_SECONDS = 30


def _resource(name: str, kind: str, namespaced: bool, verbs: str, short: str = "") -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name,
        "singularName": "" if "/" in name else kind.lower(),
        "namespaced": namespaced,
        "kind": kind,
        "verbs": verbs.split(),
    }
    if short:
        entry["shortNames"] = [short]
    return entry


_OBJECT_VERBS = "create delete get list patch update watch"
#: what kubectl reads before anything else: the version, the API groups (only core here) and core/v1's resources
DISCOVERY: dict[str, dict[str, Any]] = {
    "/version": {
        "major": KUBE_VERSION.split(".")[0].lstrip("v"),
        "minor": KUBE_VERSION.split(".")[1],
        "gitVersion": f"{KUBE_VERSION}-gpushare-standin",
        "platform": "linux/amd64",
    },
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
    "/api/v1": {
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            _resource("pods", "Pod", True, _OBJECT_VERBS, "po"),
            _resource("pods/status", "Pod", True, "get patch update"),
            _resource("pods/binding", "Binding", True, "create"),
            _resource("nodes", "Node", False, _OBJECT_VERBS, "no"),
            _resource("nodes/status", "Node", False, "get patch update"),
            _resource("events", "Event", True, _OBJECT_VERBS, "ev"),
            _resource("configmaps", "ConfigMap", True, _OBJECT_VERBS, "cm"),
            _resource("namespaces", "Namespace", False, "get", "ns"),
        ],
    },
}

_ROUTE = re.compile(
    r"^/api/v1(?:/namespaces/(?P<ns>[^/]+))?/(?P<res>pods|nodes|events|configmaps)(?:/(?P<name>[^/]+)(?:/(?P<sub>status|binding))?)?/?$"
)
_NAMESPACE = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/?$")


def status_body(code: int, reason: str, message: str, kind: str = "", name: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if kind or name:
        body["details"] = {"name": name, "kind": kind}
    return body


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _raw = b""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def setup(self) -> None:
        super().setup()
        # headers and body go out in separate writes; without this every reply waits for a delayed ACK
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.api.track(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        self.server.api.untrack(self.connection)

    # --- plumbing --------------------------------------------------------------------------------------

    def _send(self, code: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, err: StoreError) -> None:
        self._send(err.code, status_body(err.code, err.reason, err.message, err.kind, err.name))

    def _body(self) -> Any:
        try:
            return json.loads(self._raw or b"null")
        except ValueError as exc:
            raise StoreError(400, "BadRequest", f"request body is not valid JSON: {exc}") from None

    def _dispatch(self, method: str) -> None:
        # Read the body before anything can fail: left unread it would be parsed as the next request.
        length = int(self.headers.get("Content-Length") or 0)
        self._raw = self.rfile.read(length) if length else b""
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if method == "GET" and (document := DISCOVERY.get(url.path.rstrip("/"))):
                self._send(200, document)
                return
            if method == "GET" and (m := _NAMESPACE.match(url.path)):
                ns = {
                    "kind": "Namespace",
                    "apiVersion": "v1",
                    "metadata": {"name": m["ns"]},
                    "status": {"phase": "Active"},
                }
                self._send(200, ns)
                return
            route = _ROUTE.match(url.path)
            if not route:
                raise StoreError(404, "NotFound", f"the server could not find the requested resource ({url.path})")
            self.server.api.handle(self, method, route.groupdict(), query)
        except StoreError as err:
            self._fail(err)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up is routine (pools drop idle connections); anything else is a bug."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("client %s hung up", client_address)
        else:
            log.exception("request from %s failed", client_address)

    allow_reuse_address = True
    request_queue_size = 1024
    api: ApiServer


class ApiServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.store = Store()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._generation = 0  # bumped on pause so open watches end
        #: LISTs and WATCHes served, by (resource, "list" or "watch", field selector): what clients cost
        self.reads: Counter[tuple[str, str, str]] = Counter()

    # --- lifecycle ----------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        server = _Server((self.host, self.port), _Handler)
        server.api = self
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": POLL_SECONDS}, name="apiserver", daemon=True
        )
        self._thread.start()
        log.info("API server stand-in listening on %s", self.url)

    def stop(self) -> None:
        """Stop serving; open connections are cut mid-stream (watches included), as in an outage."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self.store.changed:
            self._generation += 1
            self.store.changed.notify_all()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def pause(self) -> None:
        """Simulate an outage: refuse connections until :meth:`resume`. State is kept."""
        self.stop()

    def resume(self) -> None:
        self.start()

    def track(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)

    def untrack(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)

    def kubeconfig(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "sandbox", "cluster": {"server": self.url}}],
            "users": [{"name": "sandbox", "user": {}}],
            "contexts": [{"name": "sandbox", "context": {"cluster": "sandbox", "user": "sandbox"}}],
            "current-context": "sandbox",
        }

    def write_kubeconfig(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump(self.kubeconfig()))
        return path

    # --- requests ------------------------------------------------------------------------------------------

    def handle(self, h: _Handler, method: str, route: Mapping[str, str | None], query: Mapping[str, str]) -> None:
        res, ns, name, sub = route["res"] or "", route["ns"], route["name"], route["sub"]
        if res in NAMESPACED and name and not ns:
            raise StoreError(404, "NotFound", f"{res} must be addressed within a namespace")
        if res not in NAMESPACED and ns:
            raise StoreError(404, "NotFound", f"{res} are not namespaced")
        if name is None:
            if method == "GET":
                self._list_or_watch(h, res, ns, query)
            elif method == "POST" and (ns or res not in NAMESPACED):
                self._create(h, res, ns or "", h._body())
            else:
                raise StoreError(405, "MethodNotAllowed", f"{method} is not supported on the {res} collection")
            return
        key: Key = (ns or "", name)
        if sub == "binding":
            if method != "POST" or res != "pods":
                raise StoreError(405, "MethodNotAllowed", "binding accepts POST on pods only")
            self._bind(h, key, h._body())
        elif method == "GET":
            h._send(200, self._out(res, self.store.get(res, key)))
        elif method == "DELETE":
            h._send(200, self._out(res, self._delete(res, key, h._body(), query)))
        elif method == "PUT":
            self._replace(h, res, key, h._body(), status_only=sub == "status")
        elif method == "PATCH":
            self._patch(h, res, key, status_only=sub == "status")
        else:
            raise StoreError(405, "MethodNotAllowed", f"{method} is not supported here")

    @staticmethod
    def _out(res: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """The stored object as served: a shallow copy with its kind (stored objects are read-only)."""
        return {"kind": KINDS[res], "apiVersion": "v1", **obj}

    @staticmethod
    def _selectors(res: str, query: Mapping[str, str]) -> tuple[Predicate, str | None]:
        """The selectors' predicate, and the value of the kind's indexed field that it requires (if any)."""
        try:
            fields = parse_field_selector(query.get("fieldSelector"), res)
            labels = parse_label_selector(query.get("labelSelector"))
        except SelectorError as exc:
            raise StoreError(400, "BadRequest", str(exc)) from None
        indexed = fields.required(INDEXED[res]) if res in INDEXED else None
        return (lambda obj: fields(obj) and labels(obj)), indexed

    def _list_or_watch(self, h: _Handler, res: str, ns: str | None, query: Mapping[str, str]) -> None:
        match, indexed = self._selectors(res, query)
        watch = query.get("watch") in ("true", "1")
        with self._lock:
            self.reads[res, "watch" if watch else "list", query.get("fieldSelector", "")] += 1
        if watch:
            self._watch(h, res, ns, match, indexed, query)
            return
        items, rv = self.store.list(res, ns, match, indexed)
        h._send(
            200,
            {
                "kind": f"{KINDS[res]}List",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(rv)},
                "items": [self._out(res, obj) for obj in items],
            },
        )

    def _create(self, h: _Handler, res: str, ns: str, obj: Any) -> None:
        if not isinstance(obj, dict):
            raise invalid(KINDS[res], "", "body must be an object")
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(KINDS[res], "", "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if res in NAMESPACED and meta.setdefault("namespace", ns) != ns:
            raise StoreError(400, "BadRequest", "the namespace of the object does not match the request")
        if res == "pods":
            obj.setdefault("status", {}).setdefault("phase", "Pending")
            obj.setdefault("spec", {})
        meta.pop("resourceVersion", None)
        created = self.store.create(res, (ns if res in NAMESPACED else "", meta["name"]), obj)
        h._send(201, self._out(res, created))

    def _replace(self, h: _Handler, res: str, key: Key, body: Any, status_only: bool) -> None:
        if not isinstance(body, dict):
            raise invalid(KINDS[res], key[1], "body must be an object")

        def change(current: dict[str, Any]) -> dict[str, Any]:
            return _status_update(current, body) if status_only else body

        h._send(200, self._out(res, self.store.update(res, key, change)))

    def _patch(self, h: _Handler, res: str, key: Key, status_only: bool) -> None:
        content_type = (h.headers.get("Content-Type") or "").split(";")[0].strip()
        if content_type == APPLY and not parse_qs(urlparse(h.path).query).get("fieldManager"):
            raise invalid("PatchOptions", "", "fieldManager: Required value: is required for apply patch")
        if content_type not in SUPPORTED:
            raise StoreError(415, "UnsupportedMediaType", f"the patch content type {content_type!r} is not supported")
        patch = h._body()

        def change(current: dict[str, Any]) -> dict[str, Any]:
            # The patch applies to the stored resourceVersion too: one that changes it (merge patch) or
            # tests it (JSON patch) is a precondition, checked by the store against the stored version.
            try:
                patched = apply_patch(content_type, current, patch)
            except UndecodablePatch as exc:
                raise StoreError(400, "BadRequest", str(exc)) from None
            except PatchError as exc:
                raise invalid(KINDS[res], key[1], str(exc)) from None
            if not isinstance(patched, dict) or not isinstance(patched.get("metadata", {}), dict):
                raise invalid(KINDS[res], key[1], "the patch must leave an object with an object as metadata")
            return _status_update(current, patched) if status_only else patched

        h._send(200, self._out(res, self.store.update(res, key, change)))

    def _delete(self, res: str, key: Key, body: Any, query: Mapping[str, str]) -> dict[str, Any]:
        """Pods are deleted gracefully, as by kube-apiserver: first marked with a deletionTimestamp and
        grace period (each watcher sees that change), then removed at once if the grace period is zero
        (a pod not on a node, a finished pod, or one deleted with no grace). Otherwise the pod stays until
        deleted again with no grace, which is kubelet's job once its containers have stopped."""
        if res != "pods":
            return self.store.delete(res, key)
        options = body if isinstance(body, dict) else {}
        current = self.store.get(res, key)
        grace = _grace_period(current, query.get("gracePeriodSeconds", options.get("gracePeriodSeconds")))

        def mark(pod: dict[str, Any]) -> dict[str, Any]:
            meta = pod["metadata"]
            if grace < meta.get("deletionGracePeriodSeconds", grace + 1):
                deadline = time.gmtime(time.time() + grace)
                meta["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", deadline)
                meta["deletionGracePeriodSeconds"] = grace
            return pod

        marked = self.store.update(res, key, mark)
        return self.store.delete(res, key) if grace == 0 else marked

    def _bind(self, h: _Handler, key: Key, body: Any) -> None:
        target = (body or {}).get("target") or {} if isinstance(body, dict) else {}
        node = target.get("name")
        if not node:
            raise invalid("Binding", key[1], "target.name: Required value")
        if ((body.get("metadata") or {}).get("name") or key[1]) != key[1]:
            raise StoreError(400, "BadRequest", "name in URL does not match name in Binding object")

        wanted_uid = (body.get("metadata") or {}).get("uid")

        def change(pod: dict[str, Any]) -> dict[str, Any]:
            # as kube-apiserver does: a binding naming another uid is a conflict (checked since 1.24),
            # and so is binding again, even to the same node
            uid = (pod.get("metadata") or {}).get("uid")
            if wanted_uid and wanted_uid != uid:
                raise StoreError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on pods "{key[1]}": StorageError: invalid object, Code: 4, '
                    f"Key: /registry/pods/{key[0]}/{key[1]}, ResourceVersion: 0, AdditionalErrorMsg: "
                    f"Precondition failed: UID in precondition: {wanted_uid}, UID in object meta: {uid}",
                    "pods",
                    key[1],
                )
            if bound := (pod.get("spec") or {}).get("nodeName"):
                raise StoreError(
                    409, "Conflict", f'pod {key[1]} is already assigned to node "{bound}"', "pods/binding", key[1]
                )
            pod.setdefault("spec", {})["nodeName"] = node
            # as kube-apiserver does, the Binding's annotations are set on the pod in the same write
            annotations = (body.get("metadata") or {}).get("annotations") or {}
            pod.setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)
            conditions = pod.setdefault("status", {}).setdefault("conditions", [])
            conditions[:] = [c for c in conditions if c.get("type") != "PodScheduled"]
            conditions.append({"type": "PodScheduled", "status": "True"})
            return pod

        self.store.update("pods", key, change)
        h._send(201, status_body(201, "", "", "pods/binding", key[1]))

    # --- watch ------------------------------------------------------------------------------------------

    def _watch(
        self, h: _Handler, res: str, ns: str | None, match: Predicate, indexed: str | None, query: Mapping[str, str]
    ) -> None:
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        generation = self._generation
        requested = query.get("resourceVersion") or "0"
        if requested != "0" and not requested.isdigit():
            raise StoreError(400, "BadRequest", f"resourceVersion {requested!r} is not valid")
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(type_: str, obj: Mapping[str, Any]) -> None:
            line = json.dumps({"type": type_, "object": obj}).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            h.wfile.flush()

        def in_scope(obj: Mapping[str, Any] | None) -> bool:
            if obj is None:
                return False
            return (ns is None or (obj.get("metadata") or {}).get("namespace") == ns) and match(obj)

        try:
            if requested == "0":
                items, start = self.store.list(res, ns, match, indexed)
                for obj in items:
                    send("ADDED", self._out(res, obj))
                if query.get("allowWatchBookmarks") == "true":
                    # kube-apiserver 1.27+ (not 1.20) marks the end of the replayed state at once
                    end = {"resourceVersion": str(start), "annotations": {INITIAL_EVENTS_END: "true"}}
                    send("BOOKMARK", {"kind": KINDS[res], "apiVersion": "v1", "metadata": end})
            else:
                start = int(requested)
            while time.monotonic() < deadline and generation == self._generation:
                with self.store.changed:
                    events = self.store.events_since(start)
                    if events == []:
                        self.store.changed.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                        continue
                if events is None:
                    current = self.store.resource_version
                    send("ERROR", status_body(410, "Expired", f"too old resource version: {start} ({current})"))
                    break
                for event in events:
                    start = event.rv
                    if event.kind == res and (type_ := _watch_type(event, in_scope(event.old), in_scope(event.new))):
                        send(type_, self._out(res, event.new))
            else:
                if generation != self._generation:
                    h.close_connection = True  # cut without the closing chunk: the client sees a broken stream
                    return
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except OSError:
            h.close_connection = True


#: the annotation of the bookmark that ends a watch's replay of the current state
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


def _grace_period(pod: Mapping[str, Any], requested: Any) -> int:
    """The grace period kube-apiserver gives a pod's deletion: none for a pod not on a node or finished,
    else the one requested, else the pod's terminationGracePeriodSeconds."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
        return 0
    if requested is None:
        requested = spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
    try:
        return max(0, int(requested))
    except (TypeError, ValueError):
        raise StoreError(400, "BadRequest", f"gracePeriodSeconds {requested!r} is not a number") from None


def _status_update(current: dict[str, Any], updated: dict[str, Any]) -> dict[str, Any]:
    """A write to the status subresource: as kube-apiserver does, everything but the spec is taken
    from the new object, labels and annotations included."""
    kept = {"spec": current["spec"]} if "spec" in current else {}
    return {**{k: v for k, v in updated.items() if k != "spec"}, **kept}


def _watch_type(event: Event, was: bool, now: bool) -> str | None:
    """What a watcher with a selector sees: leaving its scope is a deletion, entering it an addition."""
    if event.type == "DELETED" or not now:
        return "DELETED" if was else None
    return "MODIFIED" if was else "ADDED"


def run(port: int, kubeconfig_out: str | None) -> int:
    """Serve until interrupted (``gpushare apiserver``)."""
    from gpushare.process import wait_for_termination

    server = ApiServer(port=port)
    server.start()
    if kubeconfig_out:
        server.write_kubeconfig(kubeconfig_out)
        print(f"kubeconfig for {server.url} written to {kubeconfig_out}", flush=True)
    print(f"API server stand-in serving on {server.url}; Ctrl-C to stop", flush=True)
    try:
        wait_for_termination()
    finally:
        server.stop()
    return 0
