"""Waiting on something a test started: polling a condition, probing a server's readiness."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from gpushare.sandbox.launch import ClusterError, wait_for


def wait_until(
    predicate: Callable[[], object], timeout: float = 5.0, what: str = "condition", interval: float = 0.01
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    try:
        return wait_for(predicate, timeout, what, interval)
    except ClusterError as exc:
        raise AssertionError(str(exc)) from None


def readiness(url: str) -> int:
    """The HTTP status of ``url``/readyz."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code
