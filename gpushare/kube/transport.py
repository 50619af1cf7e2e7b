"""Building the API client, and one call through it with every failure translated into a
:class:`~gpushare.kube.errors.KubeError` that names the object."""

from __future__ import annotations

import contextlib
import json
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
