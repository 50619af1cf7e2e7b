"""The webhook's HTTPS server: thin, the decision is :func:`gpushare.webhook.review.review`."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from gpushare.webhook.review import DEFAULT_TRUSTED, BadReview, response, review

from gpushare.observability import health_reply
from gpushare.tlshttp import DEFAULT_LIMITS, HttpServer, Limits, Reply, Request, ServerTLS, parse_json

log = logging.getLogger(__name__)

PATH = "/validate"


class WebhookServer:
    def __init__(
        self,
        port: int,
        tls: ServerTLS,
        host: str = "0.0.0.0",
        trusted: Iterable[str] = DEFAULT_TRUSTED,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self._trusted = frozenset(trusted)
        self._http = HttpServer(host, port, self._handle, tls=tls, limits=limits, name="webhook")
        self.port = self._http.port

    def _handle(self, request: Request) -> Reply:
        if request.method == "GET":
            code, content_type, body = health_reply(request.path, lambda: True) or (404, "text/plain", b"not found\n")
            return Reply(code, body, content_type)
        if request.method != "POST" or request.path.rstrip("/") != PATH:
            return Reply(404, b"not found\n", "text/plain")
        try:
            verdict = review(parse_json(request.body), self._trusted)
        except (ValueError, BadReview) as exc:
            return Reply(400, json.dumps({"error": f"bad AdmissionReview: {exc}"}).encode())
        if not verdict.allowed:
            log.warning("denied: %s", verdict.message)
        return Reply(200, json.dumps(response(verdict)).encode())

    def start(self) -> None:
        self._http.start()

    def stop(self) -> None:
        self._http.stop()
