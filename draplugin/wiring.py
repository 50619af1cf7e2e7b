"""Starting the DRA kubelet plugin on a node: the node's cards and memory unit, and claims read from
the API server."""

from __future__ import annotations

from typing import Any

from gpushare.draplugin.server import DraPlugin, DraService, PluginPaths, api_claims

from gpushare.gpus.backend import GpuBackend
from gpushare.settings import NodeSettings


def start_dra_plugin(settings: NodeSettings, paths: PluginPaths, backend: GpuBackend, api: Any) -> DraPlugin:
    service = DraService(settings.node_name, backend.cards, settings.memory_unit.mib, api_claims(api), paths.cdi_dir)
    plugin = DraPlugin(paths, service)
    plugin.start()
    return plugin
