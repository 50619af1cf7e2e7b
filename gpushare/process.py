"""Process-level helpers for the long-running commands."""

from __future__ import annotations

import signal
import threading


def wait_for_termination() -> None:
    """Block until SIGTERM (how Kubernetes stops a pod) or SIGINT."""
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    stopping.wait()
