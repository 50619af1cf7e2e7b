"""``gpushare webhook``: the validating admission webhook for gpushare's pod annotations."""

from __future__ import annotations

import argparse

from gpushare.process import wait_for_termination
from gpushare.settings import UsageError, listen_address
from gpushare.tlshttp import ServerTLS, TLSFilesError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gpushare.webhook.review import DEFAULT_TRUSTED

    parser.add_argument("--port", type=int, default=8443, help="HTTPS port for the reviews, /healthz and /readyz")
    parser.add_argument(
        "--host",
        type=listen_address,
        default="0.0.0.0",
        metavar="ADDRESS",
        help="listen address (every interface unless told: the API server must reach it; in a pod, give its IP "
        "from the downward API, status.podIP)",
    )
    parser.add_argument(
        "--tls-cert", required=True, help="serving certificate (PEM), e.g. from a kubernetes.io/tls Secret"
    )
    parser.add_argument("--tls-key", required=True, help="its private key (PEM)")
    parser.add_argument(
        "--client-ca", default=None, help="require the API server's client certificate, signed by this CA"
    )
    parser.add_argument(
        "--trusted-user",
        action="append",
        default=None,
        help=f"a user allowed to write the annotations (repeatable; default: {', '.join(DEFAULT_TRUSTED)})",
    )


def run(args: argparse.Namespace) -> int:
    from gpushare.webhook.review import DEFAULT_TRUSTED
    from gpushare.webhook.server import WebhookServer

    try:
        tls = ServerTLS(args.tls_cert, args.tls_key, args.client_ca)
    except TLSFilesError as exc:
        raise UsageError(str(exc)) from None
    server = WebhookServer(args.port, tls, args.host, trusted=args.trusted_user or DEFAULT_TRUSTED)
    server.start()
    try:
        wait_for_termination()
    finally:
        server.stop()
    return 0
