"""``/metrics``, ``/healthz`` and ``/readyz`` for the long-running components."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


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
        port: int,
        ready: Callable[[], bool],
        host: str = "0.0.0.0",
        before_metrics: Callable[[], None] | None = None,
    ) -> None:
        def handler_factory(*args: Any) -> BaseHTTPRequestHandler:
            return _Handler(ready, before_metrics, *args)

        self._server = ThreadingHTTPServer((host, port), handler_factory)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="observability", daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    def __init__(self, ready: Callable[[], bool], before_metrics: Callable[[], None] | None, *args: Any) -> None:
        self._ready = ready
        self._before_metrics = before_metrics
        super().__init__(*args)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds would drown the log."""

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/metrics" and self._before_metrics is not None:
            self._before_metrics()
        reply = health_reply(path, self._ready)
        code, content_type, body = reply or (404, "text/plain", b"not found\n")
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve_http(
    port: int, ready: Callable[[], bool], host: str = "0.0.0.0", before_metrics: Callable[[], None] | None = None
) -> ObservabilityServer:
    """``before_metrics`` runs before each /metrics scrape (to refresh gauges computed on demand)."""
    return ObservabilityServer(port, ready, host, before_metrics)
