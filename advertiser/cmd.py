"""``gpushare advertiser``: publish this node's cards as a node annotation and label."""

from __future__ import annotations

import argparse

from gpushare.settings import add_node_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    parser.add_argument("--once", action="store_true", help="publish once and exit")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between re-checks (default 60)")


def run(args: argparse.Namespace) -> int:
    from gpushare.advertiser.agent import Advertiser

    from gpushare.gpus.backend import GpuBackend
    from gpushare.kube.transport import load_api
    from gpushare.nodewiring import open_cards, run_on_node
    from gpushare.settings import node_settings

    settings = node_settings(args)

    def advertiser(backend: GpuBackend) -> Advertiser:
        api = load_api(settings.kubeconfig)
        return Advertiser(api, settings.node_name, backend, settings.memory_unit, args.interval)

    if args.once:
        backend = open_cards(settings)
        try:
            advertiser(backend).publish_once()
        finally:
            backend.close()
        return 0

    def start(backend: GpuBackend) -> Advertiser:
        started = advertiser(backend)
        started.start()
        return started

    return run_on_node("advertiser", settings, None, start)
