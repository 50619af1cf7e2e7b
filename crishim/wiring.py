"""Wiring for a running CRI shim: inventory, optional API access, the pod cache and the server."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from gpushare.crishim.ending import SandboxEnd
from gpushare.crishim.reconcile import Reconciler, reconcile_limits
from gpushare.crishim.server import CreateContainerGuard, CriShim
from gpushare.crishim.starting import ContainerStart

from gpushare.enforcement.wiring import build_enforcer
from gpushare.gpus.backend import GpuBackend
from gpushare.kube.errors import KubeConfigError
from gpushare.kube.nodeapi import NodeApi
from gpushare.kube.transport import load_api
from gpushare.kube.watch import WatchCache
from gpushare.nodewiring import run_on_node
from gpushare.settings import MetricsEndpoint, NodeSettings, ShimSettings

log = logging.getLogger(__name__)

COMPONENT = "gpushare-cri-shim"


@dataclass
class RunningShim:
    shim: CriShim
    cache: WatchCache | None
    #: the API access the shim opened for itself (None when it uses its process's, or has none)
    own: NodeApi | None
    #: setting the running pods' memory limits after the start (None: no card enforces them)
    reconciler: Reconciler | None = None
    #: setting GPU containers' own limits as they start (None: no card enforces them)
    container_start: ContainerStart | None = None

    def alive(self) -> bool:
        return self.shim.alive()

    def ready(self) -> bool:
        return self.shim.serving

    def stop(self) -> None:
        self.drain(0.0)

    def drain(self, timeout: float) -> None:
        """Stop, giving the calls under way up to ``timeout`` seconds to finish (see :meth:`CriShim.drain`)."""
        if self.reconciler is not None:
            self.reconciler.stop()
        if timeout > 0:
            self.shim.drain(timeout)
        self.shim.stop()
        if self.container_start is not None:
            self.container_start.close()
        if self.own is not None:
            self.own.stop()


def start_cri_shim(
    node: NodeSettings, settings: ShimSettings, backend: GpuBackend, api: Any | None, shared: NodeApi | None = None
) -> RunningShim:
    """Start serving. ``api`` may be None (no events, no API lookups); API lookups also need
    ``settings.allow_api_fetch``. ``shared``: the node's pod watch and Event recorder, when the process
    has them (``gpushare node``); without, the shim opens what it needs and closes it on stop."""
    own = None
    if shared is None and api is not None:
        own = NodeApi(api, node.node_name, watch_pods=settings.allow_api_fetch).start()
    node_api = shared or own
    guard, cache = build_enforcer(CreateContainerGuard, node, settings, backend, api, node_api, COMPONENT)
    resolver, limiter = guard.resolver, guard.limiter
    assert limiter is not None  # build_enforcer always gives one
    limiting = any(card.limits_enforced for card in backend.cards())
    sandbox_end = SandboxEnd(settings.runtime, limiter, backend.cards) if limiting else None
    container_start = ContainerStart(settings.runtime, guard) if limiting else None
    shim = CriShim(settings.listen, settings.runtime, guard, sandbox_end, container_start)
    try:
        shim.start()
    except BaseException:
        if container_start is not None:
            container_start.close()
        if own is not None:
            own.stop()
        raise
    reconciler = None
    if limiting:
        run = functools.partial(reconcile_limits, settings.runtime, resolver, limiter, backend.cards)
        reconciler = Reconciler(run, cache.wait_synced if cache is not None else None).start()
    return RunningShim(shim, cache, own, reconciler, container_start)


def api_for(node: NodeSettings, settings: ShimSettings) -> Any | None:
    """The API access ``--kubeconfig`` gives; None (with a warning) when there is none and the shim can do without."""
    try:
        return load_api(node.kubeconfig)
    except KubeConfigError as exc:
        if settings.allow_api_fetch:
            raise
        log.warning("no Kubernetes API access (%s): corrections won't be recorded as pod Events", exc)
        return None


def run_cri_shim(node: NodeSettings, settings: ShimSettings, metrics: MetricsEndpoint | None) -> int:
    def start(backend: GpuBackend) -> RunningShim:
        running = start_cri_shim(node, settings, backend, api_for(node, settings))
        log.info(
            "CRI shim for node %s (%d card(s)): API lookups %s, device rewriting %s, CDI %s, unrequested GPUs %s",
            node.node_name,
            len(backend.cards()),
            "on" if settings.allow_api_fetch else "off",
            "on" if settings.options.rewrite_devices else "off",
            "on" if settings.options.cdi else "off",
            "blocked" if settings.options.block_unrequested_gpu else "allowed",
        )
        return running

    return run_on_node("CRI shim", node, metrics, start)
