"""Wiring for a running device plugin: inventory, API access, cache, allocator, plugin."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from deviceplugin.allocator import Allocator
from deviceplugin.devices import DeviceListTooLarge
from deviceplugin.plugin import DevicePlugin
from gpushare.cli import NodeSettings, UsageError
from gpushare.inventory import GpuBackend, open_backend
from gpushare.kube import WatchCache, load_api, node_pod_cache
from gpushare.observability import serve_http

log = logging.getLogger(__name__)


@dataclass
class RunningPlugin:
    plugin: DevicePlugin
    allocator: Allocator
    cache: WatchCache

    def stop(self) -> None:
        self.plugin.stop()
        self.cache.stop()


def start_device_plugin(settings: NodeSettings, backend: GpuBackend, api: object) -> RunningPlugin:
    cache = node_pod_cache(api, settings.node_name)
    cache.start()
    allocator = Allocator(api, settings.node_name, cache, backend.cards, settings.memory_unit)
    plugin = DevicePlugin(settings.device_plugin_dir, backend, allocator, settings.memory_unit)
    try:
        plugin.start()
    except DeviceListTooLarge as exc:
        cache.stop()
        raise UsageError(str(exc)) from None
    return RunningPlugin(plugin, allocator, cache)


def run_device_plugin(settings: NodeSettings, metrics_port: int) -> int:
    backend = open_backend(settings.gpus, settings.node_name, settings.ignored_xids)
    running = start_device_plugin(settings, backend, load_api(settings.kubeconfig))
    if metrics_port:
        serve_http(metrics_port, lambda: running.plugin.registered and running.cache.synced)
    log.info(
        "device plugin for node %s serving %d card(s) from %s",
        settings.node_name,
        len(backend.cards()),
        settings.device_plugin_dir,
    )
    try:
        threading.Event().wait()
    finally:
        running.stop()
        backend.close()
    return 0
