"""Back-off, and retrying a write through conflicts and outages."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gpushare.kube.errors import KubeConflict, KubeUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential back-off with jitter, in seconds."""

    initial: float = 0.2
    maximum: float = 10.0
    factor: float = 2.0
    jitter: float = 0.2

    def delays(self) -> Iterator[float]:
        delay = self.initial
        while True:
            yield delay * (1 + random.uniform(-self.jitter, self.jitter))
            delay = min(self.maximum, delay * self.factor)


DEFAULT_BACKOFF = Backoff()


def retrying(what: str, attempt: Callable[[], Any], retries: int, backoff: Backoff, retry_conflicts: bool) -> Any:
    """``attempt()``, repeated after an outage (and, with ``retry_conflicts``, a conflict) up to
    ``retries`` more times."""
    delays = backoff.delays()
    for remaining in range(retries, -1, -1):
        try:
            return attempt()
        except KubeConflict:
            if not retry_conflicts or remaining == 0:
                raise
            delay = next(delays)
            log.info("%s: conflict, retrying in %.2fs", what, delay)
        except KubeUnavailable as exc:
            if remaining == 0:
                raise
            delay = next(delays)
            log.warning("%s: %s; retrying in %.2fs", what, exc, delay)
        threading.Event().wait(delay)
    raise AssertionError("unreachable")
