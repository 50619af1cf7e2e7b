"""Keeps the node agent's components running: a component whose thread dies is restarted in process.

Restarting in process, rather than exiting so that the DaemonSet restarts the pod, is deliberate:
the CRI shim sits between kubelet and containerd, so exiting because the advertiser or the device
plugin died would also cut kubelet off from its container runtime until the pod came back, and
every container operation on the node would fail meanwhile. Each component is restarted on its
own, with exponential back-off (reset once it has run for a while), and ``ready()`` is false while
any of them is down, so ``/readyz`` shows it. A component that fails at the agent's start-up is
not retried: that is a configuration error, and the command exits with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpushare.kube.retry import Backoff

log = logging.getLogger(__name__)

#: how often the supervisor looks at its components
CHECK_INTERVAL = 0.2
#: a component that has run this long without dying starts over from the shortest back-off
STABLE_SECONDS = 60.0


class Component(Protocol):
    def alive(self) -> bool: ...

    def ready(self) -> bool: ...

    def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Supervised:
    name: str
    start: Callable[[], Component]


@dataclass
class _Slot:
    spec: Supervised
    delays: Iterator[float]
    running: Component | None = None
    started: float = 0.0
    retry_at: float = 0.0
    restarts: int = 0


class Supervisor:
    def __init__(
        self, specs: Sequence[Supervised], backoff: Backoff | None = None, interval: float = CHECK_INTERVAL
    ) -> None:
        self._backoff = backoff or Backoff(initial=0.5, maximum=30.0)
        self._slots = [_Slot(spec, self._backoff.delays()) for spec in specs]
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start every component in order (an error stops those started and propagates), then watch."""
        try:
            for slot in self._slots:
                slot.running, slot.started = slot.spec.start(), time.monotonic()
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for slot in reversed(self._slots):
                running, slot.running = slot.running, None
                if running is not None:
                    running.stop()

    def ready(self) -> bool:
        """Every component runs and is ready. Lock-free: a probe must not wait for a restart."""
        return all((r := s.running) is not None and r.alive() and r.ready() for s in self._slots)

    def down(self) -> list[str]:
        """The components not running right now."""
        return [s.spec.name for s in self._slots if (r := s.running) is None or not r.alive()]

    def restarts(self, name: str) -> int:
        return next(s.restarts for s in self._slots if s.spec.name == name)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                for slot in self._slots:
                    if not self._stop.is_set():
                        self._check(slot)

    def _check(self, slot: _Slot) -> None:
        now = time.monotonic()
        name = slot.spec.name
        if slot.running is not None:
            if slot.running.alive():
                if now - slot.started >= STABLE_SECONDS:
                    slot.delays = self._backoff.delays()
                return
            dead, slot.running = slot.running, None
            with contextlib.suppress(Exception):  # tidy what is left of it; it is being replaced anyway
                dead.stop()
            delay = next(slot.delays)
            slot.retry_at = now + delay
            log.error("node agent: component %s stopped unexpectedly; restarting it in %.1fs", name, delay)
            return
        if now < slot.retry_at:
            return
        try:
            slot.running, slot.started = slot.spec.start(), now
        except Exception as exc:
            delay = next(slot.delays)
            slot.retry_at = now + delay
            log.error("node agent: restarting component %s failed (%s); next try in %.1fs", name, exc, delay)
            return
        slot.restarts += 1
        log.warning("node agent: component %s restarted (restart %d)", name, slot.restarts)
