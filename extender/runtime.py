"""Wiring for a running extender: API access, cache, placement engine, binder, HTTP server."""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass
from typing import Any

from extender.bind import Binder
from extender.cache import ClusterCache
from extender.server import ExtenderServer
from extender.verbs import Placement
from gpushare import placement
from gpushare.cli import UsageError, wait_for_termination
from gpushare.kube import load_api

log = logging.getLogger(__name__)


@dataclass
class RunningExtender:
    cache: ClusterCache
    server: ExtenderServer
    binder: Binder

    def stop(self) -> None:
        self.server.stop()
        self.binder.events.close()
        self.cache.stop()


def start_extender(api: Any, port: int, policy: str, host: str = "0.0.0.0") -> RunningExtender:
    policy = policy or placement.DEFAULT_POLICY
    cache = ClusterCache(api)
    try:
        engine = Placement(cache, policy)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cache.start()
    settled = threading.Event()
    threading.Thread(target=_settle, args=(cache, engine, settled), name="settle", daemon=True).start()
    binder = Binder(api, cache, engine)
    server = ExtenderServer(port, cache, engine, binder, settled.is_set, host)
    server.start()
    log.info("extender serving on port %d with policy %s", server.port, policy)
    return RunningExtender(cache, server, binder)


def _settle(cache: ClusterCache, engine: Placement, settled: threading.Event) -> None:
    """Once the caches hold the whole cluster: build every node's row and the costs of the shapes seen
    so far, so the first pods don't pay for them, and exempt what is cached from the garbage
    collector's full passes (walking millions of pod fields stalled the verbs for a few hundred
    milliseconds at a time). The extender is ready only then."""
    cache.wait_synced(None)
    try:
        engine.warm()
    except Exception:  # readiness must not hang on it: the verbs build whatever they need themselves
        log.exception("warming the rows and costs up failed; the first pods will pay for them")
    gc.freeze()
    log.info("caches synced; %d objects exempted from full garbage collections", gc.get_freeze_count())
    settled.set()


def run_extender(port: int, kubeconfig: str | None, policy: str) -> int:
    running = start_extender(load_api(kubeconfig), port, policy)
    try:
        wait_for_termination()
    finally:
        running.stop()
    return 0
