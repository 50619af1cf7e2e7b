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

    from gpushare.kube.transport import load_api
    from gpushare.process import wait_for_termination
    from gpushare.settings import node_settings

    settings = node_settings(args)
    backend = settings.open_backend()
    advertiser = Advertiser(
        load_api(settings.kubeconfig), settings.node_name, backend, settings.memory_unit, args.interval
    )
    if args.once:
        advertiser.publish_once()
        return 0
    advertiser.start()
    try:
        wait_for_termination()
    finally:
        advertiser.stop()
        backend.close()
    return 0
