"""Wiring for a running device plugin: inventory, API access, cache, allocator, plugin."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gpushare.deviceplugin.allocator import Allocator
from gpushare.deviceplugin.devices import REPLICAS_PER_UNIT, DeviceListTooLarge, check_message_size
from gpushare.deviceplugin.plugin import DevicePlugin
from gpushare.deviceplugin.watching import WatchingPublisher

from gpushare.contract.units import MemoryUnit
from gpushare.gpus.backend import GpuBackend
from gpushare.kube.nodeapi import NodeApi
from gpushare.kube.transport import load_api
from gpushare.kube.watch import WatchCache
from gpushare.nodewiring import run_on_node
from gpushare.settings import MetricsEndpoint, NodeSettings, UsageError

log = logging.getLogger(__name__)

COMPONENT = "gpushare-device-plugin"


@dataclass
class RunningPlugin:
    plugin: DevicePlugin
    allocator: Allocator
    cache: WatchCache
    watching: WatchingPublisher
    #: the API access the plugin opened for itself (None when it uses its process's)
    own: NodeApi | None

    def alive(self) -> bool:
        return self.plugin.alive()

    def ready(self) -> bool:
        return self.plugin.registered and self.cache.synced

    def stop(self) -> None:
        self.plugin.stop()
        self.watching.close()
        if self.own is not None:
            self.own.stop()


def check_unit(backend: GpuBackend, unit: MemoryUnit, replicas: int = REPLICAS_PER_UNIT) -> None:
    """Refuse to start with settings whose device lists kubelet could not receive."""
    try:
        check_message_size(backend.cards(), unit, replicas)
    except DeviceListTooLarge as exc:
        raise UsageError(str(exc)) from None


def start_device_plugin(
    settings: NodeSettings, backend: GpuBackend, api: Any, shared: NodeApi | None = None
) -> RunningPlugin:
    """Register with kubelet and serve. ``shared``: the node's pod watch and Event recorder, when the
    process has them (``gpushare node``); without, the plugin opens its own and closes them on stop."""
    check_unit(backend, settings.memory_unit, settings.count_replicas)
    own = NodeApi(api, settings.node_name).start() if shared is None else None
    node_api = shared or own
    if node_api is None or node_api.pods is None:
        raise ValueError(f"node {settings.node_name}: the device plugin needs the node's pod watch")
    allocator = Allocator(
        api,
        settings.node_name,
        node_api.pods,
        backend.cards,
        settings.memory_unit,
        node_api.events.for_component(COMPONENT),
        settings.reread,
    )
    watching = WatchingPublisher(api, settings.node_name)
    plugin = DevicePlugin(
        settings.device_plugin_dir, backend, allocator, settings.memory_unit, settings.count_replicas, watching
    )
    try:
        plugin.start()
    except BaseException:
        watching.close()
        if own is not None:
            own.stop()
        raise
    return RunningPlugin(plugin, allocator, node_api.pods, watching, own)


def run_device_plugin(settings: NodeSettings, metrics: MetricsEndpoint | None) -> int:
    def start(backend: GpuBackend) -> RunningPlugin:
        running = start_device_plugin(settings, backend, load_api(settings.kubeconfig))
        log.info(
            "device plugin for node %s serving %d card(s) from %s",
            settings.node_name,
            len(backend.cards()),
            settings.device_plugin_dir,
        )
        return running

    return run_on_node("device plugin", settings, metrics, start)
