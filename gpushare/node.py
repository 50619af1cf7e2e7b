"""``gpushare node``: the advertiser, the device plugin and the CRI shim in one process, as the
DaemonSet runs them. They share one card inventory, so a health event reaches all three at once."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from crishim.cmd import add_arguments as add_shim_arguments

    add_shim_arguments(parser)  # node flags, shim flags and --metrics-port
    parser.add_argument("--no-cri-shim", action="store_true", help="run only the advertiser and the device plugin")
    parser.add_argument("--advertise-interval", type=float, default=60.0, help="seconds between inventory re-checks")


def run(args: argparse.Namespace) -> int:
    import logging

    from advertiser.agent import Advertiser
    from crishim.cmd import shim_settings
    from crishim.runtime import start_cri_shim
    from deviceplugin.runtime import check_unit, start_device_plugin
    from gpushare.cli import node_settings, wait_for_termination
    from gpushare.inventory import open_backend
    from gpushare.kube import load_api
    from gpushare.observability import serve_http

    log = logging.getLogger("gpushare.node")
    settings = node_settings(args)
    shim = None if args.no_cri_shim else shim_settings(args)
    backend = open_backend(settings.gpus, settings.node_name, settings.ignored_xids)
    check_unit(backend, settings.memory_unit)
    api = load_api(settings.kubeconfig)
    stops = []
    try:
        advertiser = Advertiser(api, settings.node_name, backend, settings.memory_unit, args.advertise_interval)
        advertiser.start()
        stops.append(advertiser.stop)
        plugin = start_device_plugin(settings, backend, api)
        stops.append(plugin.stop)
        cri = start_cri_shim(settings, shim, backend, api) if shim is not None else None
        if cri is not None:
            stops.append(cri.stop)

        def ready() -> bool:
            return (
                advertiser.published.is_set()
                and plugin.plugin.registered
                and plugin.cache.synced
                and (cri is None or cri.shim.serving)
            )

        if args.metrics_port:
            stops.append(serve_http(args.metrics_port, ready).stop)
        log.info(
            "node agent for %s: %d card(s), CRI shim %s",
            settings.node_name,
            len(backend.cards()),
            "off" if cri is None else f"on {shim.listen}",
        )
        wait_for_termination()
    finally:
        for stop in reversed(stops):
            stop()
        backend.close()
    return 0
