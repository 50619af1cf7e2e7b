"""``gpushare extender``: the kube-scheduler extender."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=32766)
    parser.add_argument("--kubeconfig", default=None, help="default: in-cluster config, then ~/.kube/config")
    parser.add_argument("--policy", default="", help="binpack, spread, fgd or fgdfit (default: fgdfit)")


def run(args: argparse.Namespace) -> int:
    from extender.runtime import run_extender

    return run_extender(args.port, args.kubeconfig, args.policy)
