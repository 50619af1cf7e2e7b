"""``gpushare extender``: the kube-scheduler extender."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gpushare.settings import (
    MAX_GANG_MEMBERS,
    MetricsEndpoint,
    UsageError,
    add_kubeconfig_flag,
    add_metrics_host_flag,
    policy_name,
)
from gpushare.tlshttp import DEFAULT_LIMITS, Limits, ServerTLS, TLSFilesError

if TYPE_CHECKING:
    from gpushare.extender.wiring import Serving


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=32766, help="port for the verbs kube-scheduler calls")
    add_kubeconfig_flag(parser)
    parser.add_argument(
        "--policy", type=policy_name, default=None, help="binpack, spread, fgd or fgdfit (default: fgdfit)"
    )
    tls = parser.add_argument_group("TLS (without a certificate the verbs are served over plain HTTP on loopback only)")
    tls.add_argument("--tls-cert", default=None, help="the extender's certificate (PEM)")
    tls.add_argument("--tls-key", default=None, help="its private key (PEM)")
    tls.add_argument(
        "--client-ca",
        default=None,
        help="CA that signed kube-scheduler's client certificate; required with --tls-cert "
        "(--no-client-auth to serve TLS to anyone)",
    )
    tls.add_argument("--no-client-auth", action="store_true", help="serve TLS without asking for a client certificate")
    parser.add_argument("--host", default=None, help="listen address (default: 0.0.0.0 with TLS, else 127.0.0.1)")
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="plain HTTP port for /healthz, /readyz and /metrics only (default: none)",
    )
    parser.add_argument(
        "--max-gang-members",
        type=_positive,
        default=MAX_GANG_MEMBERS,
        help=f"refuse gangs with more members than this (default: {MAX_GANG_MEMBERS}); "
        "the work of a member's filter grows with its gang's size",
    )
    parser.add_argument(
        "--dra-steering",
        action="store_true",
        help="also score the nodes for pods whose ResourceClaims ask the DRA driver gpu.gpushare.io (from the "
        "prioritize-host entry): the node where the allocator's first fit leaves the least memory free wins; "
        "watches every ResourceSlice of the driver and every ResourceClaim (docs/dra.md, Placement)",
    )
    parser.add_argument(
        "--node-agent-namespace",
        default="",
        help="the namespace of gpushare's node agent DaemonSet: no GPU pod is placed on a node whose agent pod "
        "there is not Ready (restarting, being upgraded), as kubelet would refuse it; default: not checked",
    )
    add_metrics_host_flag(parser, "--health-host")
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_LIMITS.max_body, help="larger request bodies get 413 unread"
    )
    limits.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_LIMITS.read_timeout,
        help="seconds for a TLS handshake, for a request once it has begun, and for a reply to be taken",
    )
    limits.add_argument("--workers", type=int, default=DEFAULT_LIMITS.workers, help="threads running the verbs")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def serving(args: argparse.Namespace) -> Serving:
    """The serving settings from the command line; UsageError when the TLS flags don't add up."""
    from gpushare.extender.wiring import Serving

    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.client_ca and not args.no_client_auth:
        raise UsageError("--tls-cert needs --client-ca (kube-scheduler's CA), or --no-client-auth to skip it")
    if args.client_ca and not args.tls_cert:
        raise UsageError("--client-ca needs --tls-cert and --tls-key")
    try:
        tls = ServerTLS(args.tls_cert, args.tls_key, args.client_ca) if args.tls_cert else None
    except TLSFilesError as exc:
        raise UsageError(str(exc)) from None
    limits = Limits(max_body=args.max_body_bytes, read_timeout=args.read_timeout, workers=args.workers)
    health = None if args.health_port is None else MetricsEndpoint(args.health_host, args.health_port)
    return Serving(args.port, tls, args.host, limits, health)


def run(args: argparse.Namespace) -> int:
    from gpushare.extender.wiring import run_extender

    return run_extender(
        args.kubeconfig,
        args.policy or "",
        serving(args),
        args.max_gang_members,
        args.dra_steering,
        args.node_agent_namespace,
    )
