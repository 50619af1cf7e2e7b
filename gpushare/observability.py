"""``/metrics``, ``/healthz`` and ``/readyz`` for the long-running components.

Served over plain HTTP (kubelet's probes can't show a client certificate) by the bounded server of
:mod:`gpushare.tlshttp`: a fixed few threads, a cap on connections and a deadline on every request, so
half-sent requests cost neither threads nor memory beyond that, on the address the operator gives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpushare.settings import MetricsEndpoint
from gpushare.tlshttp import HttpServer, Limits, Reply, Request

log = logging.getLogger(__name__)

#: probes and scrapes are small GETs that come a few at a time
LIMITS = Limits(max_body=0, max_header=16 << 10, read_timeout=5.0, idle_timeout=30.0, workers=2, max_connections=64)


def health_reply(path: str, ready: Callable[[], bool]) -> tuple[int, str, bytes] | None:
    """The reply for the three observability paths, or None for any other path."""
    if path == "/metrics":
        return 200, CONTENT_TYPE_LATEST, generate_latest()
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
        before_metrics: Callable[[], None] | None = None,
        limits: Limits = LIMITS,
    ) -> None:
        self._ready = ready
        self._before_metrics = before_metrics
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
        if request.path == "/metrics" and self._before_metrics is not None:
            self._before_metrics()
        code, content_type, body = health_reply(request.path, self._ready) or (404, "text/plain", b"not found\n")
        return Reply(code, body, content_type)

    def stop(self) -> None:
        self._http.stop()


def serve_http(
    endpoint: MetricsEndpoint, ready: Callable[[], bool], before_metrics: Callable[[], None] | None = None
) -> ObservabilityServer:
    """``before_metrics`` runs before each /metrics scrape (to refresh gauges computed on demand)."""
    return ObservabilityServer(endpoint, ready, before_metrics)
