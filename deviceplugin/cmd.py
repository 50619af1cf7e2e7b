"""``gpushare device-plugin``: serve both resources to this node's kubelet."""

from __future__ import annotations

import argparse

from gpushare.settings import add_node_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    parser.add_argument("--metrics-port", type=int, default=9445, help="/metrics, /healthz, /readyz (0: off)")


def run(args: argparse.Namespace) -> int:
    from gpushare.deviceplugin.wiring import run_device_plugin

    from gpushare.settings import node_settings

    return run_device_plugin(node_settings(args), args.metrics_port)
