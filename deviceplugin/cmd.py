"""``gpushare device-plugin``: serve both resources to this node's kubelet."""

from __future__ import annotations

import argparse

from gpushare.settings import add_device_plugin_flags, add_metrics_flags, add_node_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    add_device_plugin_flags(parser)
    add_metrics_flags(parser, 9445)


def run(args: argparse.Namespace) -> int:
    from gpushare.deviceplugin.wiring import run_device_plugin

    from gpushare.settings import device_plugin_settings, metrics_endpoint

    metrics = metrics_endpoint(args)
    return run_device_plugin(device_plugin_settings(args), metrics)
