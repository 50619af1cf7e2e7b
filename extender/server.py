"""The extender's HTTP server. Thin: parse, call the verb, answer. Bad input is a 400; a bug is a 500
that :mod:`gpushare.tlshttp` logs, as it does the connection handling (TLS, limits, timeouts, bounded
workers) and the JSON parsing."""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from gpushare.extender.bind import Binder, BindError
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.metrics import VERB_LATENCY, CardGauges
from gpushare.extender.reservations import Gangs
from gpushare.extender.roomwaiters import RoomWaiters
from gpushare.extender.verbs import filter_result, host_prioritize_result, preempt_result, prioritize_result
from gpushare.extender.wire import BadRequest, encode
from prometheus_client import generate_latest

from gpushare.contract.errors import quoted
from gpushare.holdings.node import node_usage
from gpushare.observability import Exposition, health_reply
from gpushare.tlshttp import HttpServer, Limits, Reply, Request, ServerTLS, parse_json

log = logging.getLogger(__name__)

#: the original extender's URL prefix (``http://<host>:32766/gpushare-scheduler/{filter,bind}``)
ORIGINAL_PREFIX = "/gpushare-scheduler"


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


def original_inspect(cache: ClusterCache, only: str | None = None) -> dict[str, Any]:
    """The original extender's ``/gpushare-scheduler/inspect`` body: per node its total and used
    gpu-mem and per card (``id`` is the card's /dev/nvidia minor, the original's numbering) the pods
    on it with what each holds there."""
    nodes = []
    errors = []
    for name in [only] if only else cache.node_names():
        view = cache.view(name)
        if view is None:
            errors.append(cache.problem(name) or f"node {name} can't be read")
            continue
        _, counted, _ = node_usage(cache.pods_on(name), view.inventory, ledger=cache.ledger(name))
        minors = {c.uuid: c.minor for c in view.inventory.cards}
        devs = [
            {
                "id": minors[card.uuid],
                "totalGPU": card.capacity,
                "usedGPU": card.used,
                "pods": [
                    {"name": p.key.split("/", 1)[1], "namespace": p.key.split("/", 1)[0], "usedGPU": p.held[card.uuid]}
                    for p in counted
                    if p.held.get(card.uuid)
                ],
            }
            for card in view.cards
        ]
        nodes.append(
            {
                "name": name,
                "totalGPU": sum(d["totalGPU"] for d in devs),
                "usedGPU": sum(d["usedGPU"] for d in devs),
                "devs": devs,
            }
        )
    return {"nodes": nodes, **({"error": "; ".join(errors)} if errors else {})}


class ExtenderServer:
    """The verbs over HTTP(S). ``tls`` (with a client CA) is how kube-scheduler proves who it is;
    without it the server only listens on loopback."""

    def __init__(
        self,
        port: int,
        cache: ClusterCache,
        engine: PlacementEngine,
        binder: Binder,
        ready: Callable[[], bool],
        host: str = "127.0.0.1",
        tls: ServerTLS | None = None,
        limits: Limits | None = None,
        gangs: Gangs | None = None,
        waiters: RoomWaiters | None = None,
    ) -> None:
        if tls is None and not _loopback(host):
            raise ValueError(f"plain HTTP is only served on loopback, not on {host}; give a TLS certificate")
        self.cache = cache
        self._ready = ready
        cards = CardGauges(cache)
        #: the per-card gauges' text, megabytes at thousands of nodes, rendered at most once per
        #: METRICS_MAX_AGE however many scrape; the registry's own metrics (verb counts and latencies, a
        #: few kB) stay current in every scrape
        card_text = Exposition(cards.exposition)
        #: the /metrics body, for this port and the health port both
        self.metrics = lambda: generate_latest() + card_text()
        self._routes: dict[str, Callable[[Any], Any]] = {
            "/filter": lambda body: filter_result(engine, body, gangs, binder.events, waiters),
            "/prioritize": lambda body: prioritize_result(engine, body),
            "/prioritize-host": lambda body: host_prioritize_result(engine, body),
            "/preempt": lambda body: preempt_result(engine, body),
            "/bind": lambda body: _bind(binder, body),
        }
        # binds wait on the API server and, onto one node, on each other: on workers of their own they
        # never hold up the filter and prioritize calls that kube-scheduler makes one pod at a time
        self._http = HttpServer(
            host, port, self._handle, tls=tls, limits=limits or Limits(), name="extender", slow=_is_bind
        )
        self.port = self._http.port

    def _handle(self, request: Request) -> Reply:
        path = request.path.rstrip("/")
        original = path == ORIGINAL_PREFIX or path.startswith(f"{ORIGINAL_PREFIX}/")
        if original:  # the original extender's paths, which old scheduler configurations point at
            path = path[len(ORIGINAL_PREFIX) :]
        if request.method == "POST":
            return self._verb(path, request.body)
        if request.method != "GET":
            return Reply(405, b"only GET and POST\n", "text/plain")
        if original and (path == "/inspect" or path.startswith("/inspect/")):
            body = original_inspect(self.cache, path[len("/inspect/") :] or None)
            return Reply(404 if body.get("error") and not body["nodes"] else 200, json.dumps(body).encode())
        if path == "/inspect" or path.startswith("/inspect/"):
            return Reply(200, json.dumps(inspect_nodes(self.cache, path[len("/inspect/") :] or None)).encode())
        code, content_type, body = health_reply(path, self._ready, self.metrics) or (404, "text/plain", b"not found\n")
        return Reply(code, body, content_type)

    def _verb(self, path: str, raw: bytes) -> Reply:
        verb = self._routes.get(path)
        if verb is None:
            return Reply(404, json.dumps({"Error": f"no such verb {quoted(path)}"}).encode())
        started = time.perf_counter()
        try:
            reply = verb(parse_json(raw))
        except ValueError as exc:  # undecodable or too deep JSON, a body of the wrong shape, a bad request
            return Reply(400, json.dumps({"Error": f"bad request to {path}: {exc}"}).encode())
        VERB_LATENCY.labels(verb=path.strip("/")).observe(time.perf_counter() - started)
        return Reply(200, encode(reply))

    @property
    def open_connections(self) -> int:
        return self._http.open_connections

    def start(self) -> None:
        self._http.start()

    def stop(self) -> None:
        self._http.stop()


def _is_bind(request: Request) -> bool:
    return request.path.rstrip("/").endswith("/bind")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _bind(binder: Binder, body: Any) -> dict[str, str]:
    if not isinstance(body, dict) or not all(isinstance(body.get(k), str) for k in ("PodName", "PodNamespace", "Node")):
        raise BadRequest("bind needs PodName, PodNamespace and Node")
    try:
        binder.bind(body["PodNamespace"], body["PodName"], body.get("PodUID") or None, body["Node"])
    except BindError as exc:
        log.warning("%s", exc)
        return {"Error": str(exc)}
    return {"Error": ""}
