"""Wiring for a running device plugin: inventory, API access, cache, allocator, plugin."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gpushare.deviceplugin.allocator import Allocator
from gpushare.deviceplugin.devices import REPLICAS_PER_UNIT, DeviceListTooLarge, check_message_size
from gpushare.deviceplugin.plugin import DevicePlugin
from gpushare.deviceplugin.watching import WatchingPublisher

from gpushare.contract.units import MemoryUnit
from gpushare.gpus.backend import GpuBackend
from gpushare.kube.transport import load_api
from gpushare.kube.watch import WatchCache, node_pod_cache
from gpushare.observability import serve_http
from gpushare.process import wait_for_termination
from gpushare.settings import MetricsEndpoint, NodeSettings, UsageError

log = logging.getLogger(__name__)


@dataclass
class RunningPlugin:
    plugin: DevicePlugin
    allocator: Allocator
    cache: WatchCache
    watching: WatchingPublisher

    def alive(self) -> bool:
        return self.plugin.alive()

    def ready(self) -> bool:
        return self.plugin.registered and self.cache.synced

    def stop(self) -> None:
        self.plugin.stop()
        self.watching.close()
        self.allocator.close()
        self.cache.stop()


def check_unit(backend: GpuBackend, unit: MemoryUnit, replicas: int = REPLICAS_PER_UNIT) -> None:
    """Refuse to start with settings whose device lists kubelet could not receive."""
    try:
        check_message_size(backend.cards(), unit, replicas)
    except DeviceListTooLarge as exc:
        raise UsageError(str(exc)) from None


def start_device_plugin(settings: NodeSettings, backend: GpuBackend, api: object) -> RunningPlugin:
    check_unit(backend, settings.memory_unit, settings.count_replicas)
    cache = node_pod_cache(api, settings.node_name)
    cache.start()
    allocator = Allocator(api, settings.node_name, cache, backend.cards, settings.memory_unit, settings.reread)
    watching = WatchingPublisher(api, settings.node_name)
    plugin = DevicePlugin(
        settings.device_plugin_dir, backend, allocator, settings.memory_unit, settings.count_replicas, watching
    )
    try:
        plugin.start()
    except BaseException:
        watching.close()
        allocator.close()
        cache.stop()
        raise
    return RunningPlugin(plugin, allocator, cache, watching)


def run_device_plugin(settings: NodeSettings, metrics: MetricsEndpoint | None) -> int:
    backend = settings.open_backend()
    check_unit(backend, settings.memory_unit, settings.count_replicas)
    running = start_device_plugin(settings, backend, load_api(settings.kubeconfig))
    server = serve_http(metrics, running.ready) if metrics else None
    log.info(
        "device plugin for node %s serving %d card(s) from %s",
        settings.node_name,
        len(backend.cards()),
        settings.device_plugin_dir,
    )
    try:
        wait_for_termination()
    finally:
        log.info("device plugin for node %s stopping", settings.node_name)
        running.stop()
        if server is not None:
            server.stop()
        backend.close()
    return 0
