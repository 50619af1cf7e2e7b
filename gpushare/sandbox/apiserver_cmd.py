"""``gpushare apiserver``: the Kubernetes API stand-in on its own, for trying the tools against it."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8080, help="port on 127.0.0.1 (0 picks a free one)")
    parser.add_argument("--kubeconfig-out", default=None, help="write a kubeconfig pointing at the server here")


def run(args: argparse.Namespace) -> int:
    from gpushare.sandbox.apiserver import run as serve

    return serve(args.port, args.kubeconfig_out)
