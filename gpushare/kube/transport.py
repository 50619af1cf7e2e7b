"""Building the API client, and one call through it with every failure translated into a
:class:`~gpushare.kube.errors.KubeError` that names the object."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from gpushare.kube.errors import (
    KubeCacheBehind,
    KubeConfigError,
    KubeConflict,
    KubeError,
    KubeNotFound,
    KubeUnavailable,
)

#: (connect, read) seconds for ordinary calls: an outage must show within seconds, not minutes
REQUEST_TIMEOUT = (2.0, 10.0)

_TRANSPORT_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)

#: while the API server stays unreachable, one line about it at most this often
OUTAGE_LOG_SECONDS = 30.0

log = logging.getLogger(__name__)


class RateLimit:
    """Per key, yes at most once every ``period`` seconds (the first time at once)."""

    def __init__(self, period: float) -> None:
        self._period = period
        self._next: dict[str, float] = {}
        self._lock = threading.Lock()

    def allow(self, key: str, now: float) -> bool:
        with self._lock:
            if now < self._next.get(key, now):
                return False
            self._next[key] = now + self._period
            return True


_OUTAGES = RateLimit(OUTAGE_LOG_SECONDS)


def report_unreachable(api: client.ApiClient, exc: BaseException) -> None:
    """One warning naming the API server and the error, at most every ``OUTAGE_LOG_SECONDS`` per server."""
    server = api.configuration.host
    if _OUTAGES.allow(server, time.monotonic()):
        log.warning("API server %s unreachable (%s: %s); retrying with back-off", server, type(exc).__name__, exc)


class _NoRetryWarnings(logging.Filter):
    """Drops urllib3's "Retrying (Retry(total=2, ...)) after connection broken by ..." warnings: an
    outage would write several per call, while :func:`report_unreachable` says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Retrying (")


_URLLIB3_POOL_LOG = logging.getLogger("urllib3.connectionpool")
_NO_RETRY_WARNINGS = _NoRetryWarnings()


def load_api(kubeconfig: str | None) -> client.ApiClient:
    """``kubeconfig`` when given; otherwise in-cluster configuration, then ``$KUBECONFIG`` or ``~/.kube/config``."""
    _URLLIB3_POOL_LOG.addFilter(_NO_RETRY_WARNINGS)  # once: a logger holds a filter at most once
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


def translate(exc: Exception, what: str) -> KubeError:
    if isinstance(exc, ApiException):
        detail, causes = exc.reason, []
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            status = json.loads(exc.body)
            detail = status.get("message", detail)
            causes = [c.get("reason") for c in (status.get("details") or {}).get("causes") or []]
        if exc.status == 504 and "ResourceVersionTooLarge" in causes:
            return KubeCacheBehind(f"{what}: API server answered 504: {detail}")
        if exc.status == 409:
            return KubeConflict(f"{what}: conflict: {detail}")
        if exc.status == 404:
            return KubeNotFound(f"{what}: not found")
        if exc.status is None or exc.status >= 500 or exc.status == 429:
            return KubeUnavailable(f"{what}: API server answered {exc.status}: {detail}")
        return KubeError(f"{what}: API server answered {exc.status}: {detail}")
    return KubeUnavailable(f"{what}: API server unreachable ({type(exc).__name__}: {exc})")


def call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one API call returning parsed JSON, with errors translated."""
    kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
    try:
        reply = fn(*args, _preload_content=False, **kwargs)
        return json.loads(reply.data) if reply.data else {}
    except _TRANSPORT_ERRORS as exc:
        raise translate(exc, what) from None
