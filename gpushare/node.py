"""``gpushare node``: the advertiser, the device plugin and the CRI shim in one process, as the
DaemonSet runs them. They share one card inventory, so a health event reaches all three at once.
Each runs under :mod:`gpushare.supervisor`, which restarts one that dies (its docstring says why
that beats exiting) and keeps ``/readyz`` false while one is down."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpushare.crishim.wiring import ShimSettings
    from gpushare.gpus.backend import GpuBackend
    from gpushare.settings import NodeSettings
    from gpushare.supervisor import Supervised


#: where the DaemonSet's probes and Prometheus look (deploy/node-agent.yaml)
DEFAULT_METRICS_PORT = 9410


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gpushare.crishim.cmd import add_shim_flags
    from gpushare.settings import add_device_plugin_flags, add_metrics_flags, add_node_flags

    add_node_flags(parser)
    add_device_plugin_flags(parser)
    add_shim_flags(parser)
    add_metrics_flags(parser, DEFAULT_METRICS_PORT)
    parser.add_argument("--no-cri-shim", action="store_true", help="run only the advertiser and the device plugin")
    parser.add_argument("--advertise-interval", type=float, default=60.0, help="seconds between inventory re-checks")


def components(
    settings: NodeSettings, shim: ShimSettings | None, backend: GpuBackend, api: object, advertise_interval: float
) -> list[Supervised]:
    """The node agent's components, each as a way to start it afresh."""
    from gpushare.advertiser.agent import Advertiser
    from gpushare.crishim.wiring import start_cri_shim
    from gpushare.deviceplugin.wiring import start_device_plugin
    from gpushare.supervisor import Supervised

    def start_advertiser() -> Advertiser:
        advertiser = Advertiser(api, settings.node_name, backend, settings.memory_unit, advertise_interval)
        advertiser.start()
        return advertiser

    found = [
        Supervised("advertiser", start_advertiser),
        Supervised("device-plugin", lambda: start_device_plugin(settings, backend, api)),
    ]
    if shim is not None:
        found.append(Supervised("cri-shim", lambda: start_cri_shim(settings, shim, backend, api)))
    return found


def run(args: argparse.Namespace) -> int:
    import logging

    from gpushare.crishim.cmd import shim_settings
    from gpushare.deviceplugin.wiring import check_unit
    from gpushare.kube.transport import load_api
    from gpushare.observability import serve_http
    from gpushare.process import wait_for_termination
    from gpushare.settings import device_plugin_settings, metrics_endpoint
    from gpushare.supervisor import Supervisor

    log = logging.getLogger("gpushare.node")
    metrics = metrics_endpoint(args)
    settings = device_plugin_settings(args)
    shim = None if args.no_cri_shim else shim_settings(args)
    backend = settings.open_backend()
    check_unit(backend, settings.memory_unit, settings.count_replicas)
    api = load_api(settings.kubeconfig)
    supervisor = Supervisor(components(settings, shim, backend, api, args.advertise_interval))
    server = None
    try:
        supervisor.start()
        if metrics is not None:
            server = serve_http(metrics, supervisor.ready)
        log.info(
            "node agent for %s: %d card(s), CRI shim %s",
            settings.node_name,
            len(backend.cards()),
            "off" if shim is None else f"on {shim.listen}",
        )
        wait_for_termination()
    finally:
        if server is not None:
            server.stop()
        supervisor.stop()
        backend.close()
    return 0
