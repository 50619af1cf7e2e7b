"""Wiring for a running extender: API access, cache, placement engine, binder, HTTP server."""

from __future__ import annotations

import gc
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any

from gpushare.extender.bind import Binder
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.reservations import Gangs
from gpushare.extender.roomwaiters import RoomWaiters
from gpushare.extender.server import ExtenderServer

from gpushare import placement
from gpushare.kube.transport import load_api
from gpushare.observability import ObservabilityServer, serve_http
from gpushare.process import wait_for_termination
from gpushare.settings import MAX_GANG_MEMBERS, MetricsEndpoint, UsageError
from gpushare.tlshttp import Limits, ServerTLS

log = logging.getLogger(__name__)


@dataclass
class RunningExtender:
    cache: ClusterCache
    server: ExtenderServer
    binder: Binder
    gangs: Gangs
    waiters: RoomWaiters
    health: ObservabilityServer | None = None

    def stop(self) -> None:
        self.server.stop()
        self.waiters.close()
        if self.health is not None:
            self.health.stop()
        self.binder.events.close()
        self.cache.stop()


@dataclass(frozen=True, slots=True)
class Serving:
    """How the verbs are served: with ``tls``, on every interface and (with a client CA in the context)
    to kube-scheduler alone; without, plain HTTP on loopback only."""

    port: int
    tls: ServerTLS | None = None
    host: str | None = None
    limits: Limits | None = None
    #: plain /healthz, /readyz and /metrics for kubelet's probes, which can't show a client certificate
    health: MetricsEndpoint | None = None


def start_extender(
    api: Any,
    port: int,
    policy: str,
    host: str | None = None,
    serving: Serving | None = None,
    max_gang_members: int = MAX_GANG_MEMBERS,
    dra_steering: bool = False,
    node_agent_namespace: str = "",
) -> RunningExtender:
    serving = serving or Serving(port, host=host)
    host = serving.host or ("0.0.0.0" if serving.tls is not None else "127.0.0.1")
    policy = policy or placement.DEFAULT_POLICY
    cache = ClusterCache(api, dra_steering, node_agent_namespace)
    try:
        engine = PlacementEngine(cache, policy)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cache.start()
    settled = threading.Event()
    threading.Thread(target=_settle, args=(cache, engine, settled), name="settle", daemon=True).start()
    binder = Binder(api, cache, engine)
    waiters = RoomWaiters(api, cache)
    gangs = Gangs(api, cache, engine, binder, waiters, max_gang_members)
    try:
        server = ExtenderServer(
            serving.port, cache, engine, binder, settled.is_set, host, serving.tls, serving.limits, gangs, waiters
        )
    except ValueError as exc:
        waiters.close()
        cache.stop()
        raise UsageError(str(exc)) from None
    server.start()
    health = None
    if serving.health is not None:
        health = serve_http(serving.health, settled.is_set, server.metrics)
    log.info(
        "extender serving %s on %s port %d with policy %s",
        "HTTPS" if serving.tls is not None else "plain HTTP",
        host,
        server.port,
        policy,
    )
    return RunningExtender(cache, server, binder, gangs, waiters, health)


def _settle(cache: ClusterCache, engine: PlacementEngine, settled: threading.Event) -> None:
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


#: seconds a thread may hold the GIL while another waits for it (Python's default is 5 ms)
SWITCH_INTERVAL = 0.001


def run_extender(
    kubeconfig: str | None,
    policy: str,
    serving: Serving,
    max_gang_members: int = MAX_GANG_MEMBERS,
    dra_steering: bool = False,
    node_agent_namespace: str = "",
) -> int:
    # A filter that arrives while a watch or a bind thread runs Python waits for the GIL up to the
    # switch interval, which set the verbs' p99 (docs/extender.md has the figures).
    sys.setswitchinterval(SWITCH_INTERVAL)
    running = start_extender(
        load_api(kubeconfig),
        serving.port,
        policy,
        serving=serving,
        max_gang_members=max_gang_members,
        dra_steering=dra_steering,
        node_agent_namespace=node_agent_namespace,
    )
    try:
        wait_for_termination()
    finally:
        running.stop()
    return 0
