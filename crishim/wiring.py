"""Wiring for a running CRI shim: inventory, optional API access, the pod cache and the server."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gpushare.crishim.resolve import CachedPods, Resolver, Target
from gpushare.crishim.rewrite import RewriteOptions
from gpushare.crishim.server import CreateContainerGuard, CriShim, EventSink

from gpushare.gpus.backend import GpuBackend
from gpushare.kube.errors import KubeConfigError
from gpushare.kube.events import EventRecorder
from gpushare.kube.transport import load_api
from gpushare.kube.watch import WatchCache, node_pod_cache
from gpushare.observability import serve_http
from gpushare.process import wait_for_termination
from gpushare.settings import MetricsEndpoint, NodeSettings

log = logging.getLogger(__name__)

COMPONENT = "gpushare-cri-shim"


@dataclass(frozen=True, slots=True)
class ShimSettings:
    listen: str
    runtime: str
    allow_api_fetch: bool
    options: RewriteOptions


def pod_events(recorder: EventRecorder) -> EventSink:
    """The guard's Events, recorded about the pod its CreateContainer call is for."""

    def record(target: Target, reason: str, message: str, type_: str) -> None:
        pod = {"kind": "Pod", "metadata": {"name": target.pod, "namespace": target.namespace, "uid": target.uid}}
        recorder.record(pod, reason=reason, message=message, type_=type_)

    return record


@dataclass
class RunningShim:
    shim: CriShim
    cache: WatchCache | None
    events: EventRecorder | None

    def alive(self) -> bool:
        return self.shim.alive()

    def ready(self) -> bool:
        return self.shim.serving

    def stop(self) -> None:
        self.shim.stop()
        if self.cache is not None:
            self.cache.stop()
        if self.events is not None:
            self.events.close()


def start_cri_shim(node: NodeSettings, settings: ShimSettings, backend: GpuBackend, api: Any | None) -> RunningShim:
    """Start serving. ``api`` may be None (no events, no API lookups); API lookups also need
    ``settings.allow_api_fetch``."""
    cache = None
    if api is not None and settings.allow_api_fetch:
        cache = node_pod_cache(api, node.node_name)
        cache.start()
    events = EventRecorder(api, COMPONENT) if api is not None else None
    guard = CreateContainerGuard(
        Resolver(node.memory_unit, CachedPods(api, cache, node.node_name) if cache is not None else None),
        backend.cards,
        node.memory_unit,
        settings.options,
        pod_events(events) if events is not None else None,
    )
    shim = CriShim(settings.listen, settings.runtime, guard)
    try:
        shim.start()
    except BaseException:
        if cache is not None:
            cache.stop()
        if events is not None:
            events.close()
        raise
    return RunningShim(shim, cache, events)


def _api_for(node: NodeSettings, settings: ShimSettings) -> Any | None:
    try:
        return load_api(node.kubeconfig)
    except KubeConfigError as exc:
        if settings.allow_api_fetch:
            raise
        log.warning("no Kubernetes API access (%s): corrections won't be recorded as pod Events", exc)
        return None


def run_cri_shim(node: NodeSettings, settings: ShimSettings, metrics: MetricsEndpoint | None) -> int:
    backend = node.open_backend()
    running = start_cri_shim(node, settings, backend, _api_for(node, settings))
    server = serve_http(metrics, lambda: running.shim.serving) if metrics else None
    log.info(
        "CRI shim for node %s (%d card(s)): API lookups %s, device rewriting %s, CDI %s, unrequested GPUs %s",
        node.node_name,
        len(backend.cards()),
        "on" if settings.allow_api_fetch else "off",
        "on" if settings.options.rewrite_devices else "off",
        "on" if settings.options.cdi else "off",
        "blocked" if settings.options.block_unrequested_gpu else "allowed",
    )
    try:
        wait_for_termination()
    finally:
        if server is not None:
            server.stop()
        running.stop()
        backend.close()
    return 0
