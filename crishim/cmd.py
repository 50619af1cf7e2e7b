"""``gpushare cri-shim``: sit between kubelet and the container runtime, enforcing card assignments."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gpushare.settings import add_metrics_flags, add_node_flags

if TYPE_CHECKING:  # the wiring pulls in grpc; the command module stays light
    from gpushare.crishim.wiring import ShimSettings

DEFAULT_LISTEN = "unix:///run/gpushare/cri.sock"
DEFAULT_RUNTIME = "unix:///run/containerd/containerd.sock"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    add_shim_flags(parser)
    add_metrics_flags(parser, 9446)


def add_shim_flags(parser: argparse.ArgumentParser) -> None:
    """The shim's own flags; shared with ``gpushare node``."""
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help="the socket kubelet connects to (mode 0600)")
    parser.add_argument("--runtime", default=DEFAULT_RUNTIME, help="the real runtime's CRI socket")
    api = parser.add_mutually_exclusive_group()
    api.add_argument(
        "--allow-api-fetch",
        dest="allow_api_fetch",
        action="store_true",
        default=True,
        help="read a pod from the API server when sandbox_config lacks its card assignment, and check cards "
        "for over-commit against the node's pods (default)",
    )
    api.add_argument(
        "--no-api-fetch",
        dest="allow_api_fetch",
        action="store_false",
        help="trust sandbox_config alone; containers without an assignment there are refused",
    )
    parser.add_argument(
        "--rewrite-devices",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also correct the /dev/nvidia* device nodes (for runtimes without the NVIDIA hook)",
    )
    parser.add_argument(
        "--cdi", action=argparse.BooleanOptionalAction, default=False, help="also correct CDI device names"
    )
    parser.add_argument(
        "--block-unrequested-gpu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give containers that request no GPU NVIDIA_VISIBLE_DEVICES=void (default: on)",
    )


def shim_settings(args: argparse.Namespace) -> ShimSettings:
    """The shim's settings from its flags; shared with ``gpushare node``."""
    from gpushare.crishim.rewrite import RewriteOptions
    from gpushare.crishim.server import socket_path
    from gpushare.crishim.wiring import ShimSettings

    from gpushare.settings import UsageError

    for flag, address in (("--listen", args.listen), ("--runtime", args.runtime)):
        try:
            socket_path(address)
        except ValueError as exc:
            raise UsageError(f"{flag} {exc}") from None
    return ShimSettings(
        listen=args.listen,
        runtime=args.runtime,
        allow_api_fetch=args.allow_api_fetch,
        options=RewriteOptions(
            rewrite_devices=args.rewrite_devices, cdi=args.cdi, block_unrequested_gpu=args.block_unrequested_gpu
        ),
    )


def run(args: argparse.Namespace) -> int:
    from gpushare.crishim.wiring import run_cri_shim

    from gpushare.kube.errors import KubeConfigError
    from gpushare.settings import UsageError, metrics_endpoint, node_settings

    metrics = metrics_endpoint(args)
    try:
        return run_cri_shim(node_settings(args), shim_settings(args), metrics)
    except KubeConfigError as exc:
        raise UsageError(f"{exc} (or pass --no-api-fetch)") from None
