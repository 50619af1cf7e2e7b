"""The advertiser loop: publish the node's cards, then keep the annotation true.

It patches only when something changed, re-checks every ``interval`` seconds, re-checks at once on a
health event, and rides out API outages with back-off (the next successful check publishes whatever
changed meanwhile).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from gpushare.advertiser.publish import node_patch

from gpushare.contract.units import MemoryUnit
from gpushare.gpus.backend import GpuBackend, HealthEvent
from gpushare.kube.errors import KubeError
from gpushare.kube.objects import get_node, patch_node
from gpushare.kube.retry import Backoff

log = logging.getLogger(__name__)


#: the waits between failed publishes
PUBLISH_BACKOFF = Backoff(initial=0.5, maximum=30.0)


@dataclass(eq=False)
class Advertiser:
    """Keeps ``node``'s inventory annotation true to ``backend``'s cards, in ``unit``; re-checks every
    ``interval`` seconds."""

    api: object
    node: str
    backend: GpuBackend
    unit: MemoryUnit
    interval: float = 60.0
    backoff: Backoff = PUBLISH_BACKOFF
    #: set once the annotation has been brought up to date
    published: threading.Event = field(default_factory=threading.Event, init=False)
    _wake: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    #: what :meth:`publish_once` writes, for the log, and the name of the thread that keeps it
    what = "the inventory"
    thread_name = "advertiser"

    def __post_init__(self) -> None:
        self.backend.subscribe(self._on_health)

    def _on_health(self, event: HealthEvent) -> None:
        self._wake.set()

    def publish_once(self) -> bool:
        """Bring the node annotation up to date. Returns whether a patch was sent."""
        node = get_node(self.api, self.node)
        cards = self.backend.cards()
        patch = node_patch(node, cards, self.unit)
        if patch is not None:
            patch_node(self.api, self.node, patch, retries=2)
            healthy = sum(c.healthy for c in cards)
            log.info(
                "node %s: published %d card(s) (%d healthy) in %s units",
                self.node,
                len(cards),
                healthy,
                self.unit.name,
            )
        self.published.set()
        return patch is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
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
        self.backend.unsubscribe(self._on_health)

    def _run(self) -> None:
        delays = self.backoff.delays()
        while not self._stop.is_set():
            try:
                self.publish_once()
                delays = self.backoff.delays()
                wait = self.interval
            except KubeError as exc:
                wait = next(delays)
                log.warning("node %s: publishing %s failed (%s); retrying in %.1fs", self.node, self.what, exc, wait)
            self._wake.wait(wait)
            self._wake.clear()
