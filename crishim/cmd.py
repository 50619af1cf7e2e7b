"""``gpushare cri-shim``: sit between kubelet and the container runtime, enforcing card assignments."""

from __future__ import annotations

import argparse

from gpushare.settings import add_metrics_flags, add_node_flags, add_shim_flags

DEFAULT_LISTEN = "unix:///run/gpushare/cri.sock"
DEFAULT_RUNTIME = "unix:///run/containerd/containerd.sock"
DEFAULT_METRICS_PORT = 9446


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    add_shim_flags(parser, listen=DEFAULT_LISTEN, runtime=DEFAULT_RUNTIME)
    add_metrics_flags(parser, DEFAULT_METRICS_PORT)


def run(args: argparse.Namespace) -> int:
    from gpushare.crishim.wiring import run_cri_shim

    from gpushare.kube.errors import KubeConfigError
    from gpushare.settings import UsageError, metrics_endpoint, node_settings, shim_settings

    metrics = metrics_endpoint(args)
    try:
        return run_cri_shim(node_settings(args), shim_settings(args), metrics)
    except KubeConfigError as exc:
        raise UsageError(f"{exc} (or pass --no-api-fetch)") from None
