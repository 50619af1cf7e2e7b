"""The advertiser loop: publish the node's cards, then keep the annotation true.

It patches only when something changed, re-checks every ``interval`` seconds, re-checks at once on a
health event, and rides out API outages with back-off (the next successful check publishes whatever
changed meanwhile).
"""

from __future__ import annotations

import logging
import threading

from gpushare.advertiser.publish import node_patch

from gpushare.contract.units import MemoryUnit
from gpushare.gpus.backend import GpuBackend, HealthEvent
from gpushare.kube.errors import KubeError
from gpushare.kube.objects import get_node, patch_node
from gpushare.kube.retry import Backoff

log = logging.getLogger(__name__)


class Advertiser:
    def __init__(
        self,
        api: object,
        node: str,
        backend: GpuBackend,
        unit: MemoryUnit,
        interval: float = 60.0,
        backoff: Backoff | None = None,
    ) -> None:
        self._api = api
        self._node = node
        self._backend = backend
        self._unit = unit
        self._interval = interval
        self._backoff = backoff or Backoff(initial=0.5, maximum=30.0)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = threading.Event()
        backend.subscribe(self._on_health)

    def _on_health(self, event: HealthEvent) -> None:
        self._wake.set()

    def publish_once(self) -> bool:
        """Bring the node annotation up to date. Returns whether a patch was sent."""
        node = get_node(self._api, self._node)
        cards = self._backend.cards()
        patch = node_patch(node, cards, self._unit)
        if patch is not None:
            patch_node(self._api, self._node, patch, retries=2)
            healthy = sum(c.healthy for c in cards)
            log.info(
                "node %s: published %d card(s) (%d healthy) in %s units",
                self._node,
                len(cards),
                healthy,
                self._unit.name,
            )
        self.published.set()
        return patch is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="advertiser", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ready(self) -> bool:
        return self.published.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._backend.unsubscribe(self._on_health)

    def _run(self) -> None:
        delays = self._backoff.delays()
        while not self._stop.is_set():
            try:
                self.publish_once()
                delays = self._backoff.delays()
                wait = self._interval
            except KubeError as exc:
                wait = next(delays)
                log.warning("node %s: publishing the inventory failed (%s); retrying in %.1fs", self._node, exc, wait)
            self._wake.wait(wait)
            self._wake.clear()
