"""``gpushare sandbox``: a whole cluster with simulated cards on this machine."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="a simulated node, e.g. node-a=2xA100-80GB:81920,1xT4:15360 (repeatable; default: 2 mixed nodes)",
    )
    parser.add_argument(
        "--nvml-fake",
        action="append",
        default=[],
        metavar="MACHINE",
        help="a node running 'gpushare node --gpus nvml' on the fake libnvidia-ml presenting MACHINE (a file, "
        "or one of gpushare/sandbox/fakenvml/machines: dgx-a100, mixed, mig, lost-card, faulty; repeatable; "
        "without --node, only these nodes run)",
    )
    parser.add_argument("--policy", default="", help="placement policy for the extender (default: its default)")
    parser.add_argument("--no-containers", action="store_true", help="don't start real containers even if possible")
    parser.add_argument(
        "--keep-running", action="store_true", help="stay up for kubectl, gpushare inspect and /metrics"
    )
    parser.add_argument(
        "--standin",
        action="store_true",
        help="use the API server stand-in and kubelet emulator even where a real Kubernetes can run "
        "(the default is real kube-apiserver, kube-scheduler and kubelets when their binaries are built)",
    )


def run(args: argparse.Namespace) -> int:
    from gpushare.sandbox.cluster import run as run_sandbox

    return run_sandbox(
        args.node, args.policy, not args.no_containers, args.keep_running, args.standin, nvml_fake=args.nvml_fake
    )
