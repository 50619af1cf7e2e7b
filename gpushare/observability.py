"""``/metrics``, ``/healthz`` and ``/readyz`` for the long-running components.

Served over plain HTTP (kubelet's probes can't show a client certificate) by the bounded server of
:mod:`gpushare.tlshttp`: a fixed few threads, a cap on connections and a deadline on every request, so
half-sent requests cost neither threads nor memory beyond that, on the address the operator gives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpushare.settings import MetricsEndpoint
from gpushare.tlshttp import HttpServer, Limits, Reply, Request

log = logging.getLogger(__name__)

#: probes and scrapes are small GETs that come a few at a time
LIMITS = Limits(max_body=0, max_header=16 << 10, read_timeout=5.0, idle_timeout=30.0, workers=2, max_connections=64)
#: seconds a rendered /metrics body is served again (scrapers come every 15 s or more)
METRICS_MAX_AGE = 2.0


class Exposition:
    """A /metrics body that costs what it costs at most once per ``max_age`` seconds: ``render`` runs for
    one scrape at a time, and every scrape within ``max_age`` of its end (those that waited for it
    included) gets its body. However many scrapers come, and however often, the renders take at most
    their own time in every ``max_age``."""

    def __init__(self, render: Callable[[], bytes], max_age: float = METRICS_MAX_AGE) -> None:
        self._render = render
        self._max_age = max_age
        self._lock = threading.Lock()
        self._body = b""
        self._rendered_at = -max_age

    def __call__(self) -> bytes:
        with self._lock:
            if time.monotonic() - self._rendered_at >= self._max_age:
                self._body = self._render()
                self._rendered_at = time.monotonic()
            return self._body


def health_reply(
    path: str, ready: Callable[[], bool], metrics: Callable[[], bytes] = generate_latest
) -> tuple[int, str, bytes] | None:
    """The reply for the three observability paths, or None for any other path; ``metrics`` gives the
    /metrics body."""
    if path == "/metrics":
        return 200, CONTENT_TYPE_LATEST, metrics()
    if path == "/healthz":
        return 200, "text/plain", b"ok\n"
    if path == "/readyz":
        return (200, "text/plain", b"ready\n") if ready() else (503, "text/plain", b"not ready\n")
    return None


class ObservabilityServer:
    def __init__(
        self,
        endpoint: MetricsEndpoint,
        ready: Callable[[], bool],
        metrics: Callable[[], bytes] = generate_latest,
        limits: Limits = LIMITS,
    ) -> None:
        self._ready = ready
        self._metrics = metrics
        self._http = HttpServer(endpoint.host, endpoint.port, self._handle, limits=limits, name="observability")
        self.host = self._http.host
        self.port = self._http.port
        self._http.start()
        log.info("serving /metrics, /healthz and /readyz on %s port %d", self.host, self.port)

    @property
    def open_connections(self) -> int:
        return self._http.open_connections

    def _handle(self, request: Request) -> Reply:
        if request.method != "GET":
            return Reply(405, b"only GET\n", "text/plain")
        reply = health_reply(request.path, self._ready, self._metrics)
        code, content_type, body = reply or (404, "text/plain", b"not found\n")
        return Reply(code, body, content_type)

    def stop(self) -> None:
        self._http.stop()


def serve_http(
    endpoint: MetricsEndpoint, ready: Callable[[], bool], metrics: Callable[[], bytes] = generate_latest
) -> ObservabilityServer:
    """``metrics`` gives the /metrics body (an :class:`Exposition` where rendering it is costly)."""
    return ObservabilityServer(endpoint, ready, metrics)
