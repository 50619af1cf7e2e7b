"""The extender's HTTP server. Thin: parse, call the verb, answer; the server never dies on input."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from extender.bind import Binder, BindError
from extender.cache import ClusterCache
from extender.metrics import CARD_ALLOCATED, CARD_TOTAL, VERB_LATENCY
from extender.verbs import (
    BadRequest,
    Placement,
    filter_result,
    host_prioritize_result,
    preempt_result,
    prioritize_result,
)
from extender.wire import encode
from gpushare.observability import health_reply

log = logging.getLogger(__name__)


def inspect_nodes(cache: ClusterCache, only: str | None = None) -> dict[str, Any]:
    """Per-card allocation as this extender sees it (in-flight binds included)."""
    nodes = {}
    for name in [only] if only else cache.node_names():
        view = cache.view(name)
        if view is None:
            nodes[name] = {"error": cache.problem(name)}
            continue
        nodes[name] = {
            "unit": view.inventory.unit.name,
            "cards": [
                {
                    "index": c.index,
                    "uuid": c.uuid,
                    "model": c.model,
                    "used": c.used,
                    "capacity": c.capacity,
                    "healthy": c.healthy,
                }
                for c in view.cards
            ],
        }
    return {"nodes": nodes}


def refresh_card_gauges(cache: ClusterCache) -> None:
    for name in cache.node_names():
        view = cache.view(name)
        for card in view.cards if view else ():
            CARD_ALLOCATED.labels(node=name, card=str(card.index)).set(card.used)
            CARD_TOTAL.labels(node=name, card=str(card.index)).set(card.capacity)


class ExtenderServer:
    def __init__(
        self,
        port: int,
        cache: ClusterCache,
        engine: Placement,
        binder: Binder,
        ready: Callable[[], bool],
        host: str = "0.0.0.0",
    ) -> None:
        self.cache = cache
        routes: dict[str, Callable[[Any], Any]] = {
            "/filter": lambda body: filter_result(engine, body),
            "/prioritize": lambda body: prioritize_result(engine, body),
            "/prioritize-host": lambda body: host_prioritize_result(engine, body),
            "/preempt": lambda body: preempt_result(engine, body),
            "/bind": lambda body: _bind(binder, body),
        }
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # Headers and body go out as two writes; with Nagle on, a keep-alive client (kube-scheduler)
                # would wait for its delayed ACK, 40 ms per call.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug(format, *args)

            def _reply(self, code: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                verb = routes.get(self.path.rstrip("/"))
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if verb is None:
                    self._reply(404, json.dumps({"Error": f"no such verb {self.path}"}).encode())
                    return
                started = time.perf_counter()
                try:
                    reply = verb(json.loads(raw))
                except ValueError as exc:  # undecodable JSON and BadRequest alike
                    self._reply(400, json.dumps({"Error": f"bad request to {self.path}: {exc}"}).encode())
                    return
                except Exception as exc:
                    log.exception("%s failed", self.path)
                    reply = {"Error": f"{self.path}: internal error: {exc}"}
                VERB_LATENCY.labels(verb=self.path.strip("/")).observe(time.perf_counter() - started)
                self._reply(200, encode(reply))

            def do_GET(self) -> None:
                path = self.path.split("?")[0].rstrip("/")
                if path == "/inspect" or path.startswith("/inspect/"):
                    node = path[len("/inspect/") :] or None if path != "/inspect" else None
                    self._reply(200, json.dumps(inspect_nodes(server.cache, node)).encode())
                    return
                if path == "/metrics":
                    refresh_card_gauges(server.cache)
                reply = health_reply(path, ready)
                code, content_type, body = reply or (404, "text/plain", b"not found\n")
                self._reply(code, body, content_type)

        self._httpd = _Server((host, port), Handler)
        self.port = self._httpd.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self._httpd.serve_forever, name="extender-http", daemon=True).start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    #: kube-scheduler and its retries can open many connections at once; the default backlog is 5
    request_queue_size = 1024


def _bind(binder: Binder, body: Any) -> dict[str, str]:
    if not isinstance(body, dict) or not all(isinstance(body.get(k), str) for k in ("PodName", "PodNamespace", "Node")):
        raise BadRequest("bind needs PodName, PodNamespace and Node")
    try:
        binder.bind(body["PodNamespace"], body["PodName"], body.get("PodUID") or None, body["Node"])
    except BindError as exc:
        log.warning("%s", exc)
        return {"Error": str(exc)}
    return {"Error": ""}
