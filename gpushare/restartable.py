"""A background thread that a component can start again after it ended (stopped, or died)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class RestartableThread:
    """Runs ``target`` in a daemon thread called ``name``; each :meth:`start` runs it in a new thread."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._target = target
        self._name = name
        self._thread: threading.Thread | None = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Run ``target`` in a new thread; the caller checks :meth:`alive` first."""
        self._thread = threading.Thread(target=self._target, name=self._name, daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (at most ``timeout`` seconds); no-op if it never started."""
        if self._thread is not None:
            self._thread.join(timeout)
