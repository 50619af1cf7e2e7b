"""``gpushare sandbox``: a whole cluster with simulated cards on this machine."""

from __future__ import annotations

import argparse
import sys


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
    """On a real Kubernetes when it can run here (and ``--standin`` is off), else on the stand-ins."""
    from gpushare.sandbox.cluster import DEFAULT_NODES, parse_node

    # with fake-NVML nodes and no --node, the fake-NVML nodes run alone
    specs = [parse_node(n) for n in args.node or (() if args.nvml_fake else DEFAULT_NODES)]
    if not args.standin:
        from gpushare.sandbox.realcluster import realcluster_available
        from gpushare.sandbox.realsandbox import run_real

        reason = "--no-containers asks for no containers" if args.no_containers else realcluster_available()
        if reason is None:
            return run_real(specs, args.policy, args.keep_running, nvml_fake=args.nvml_fake)
        print(f"gpushare sandbox: using the API stand-in and kubelet emulator: {reason}", file=sys.stderr)
    from gpushare.sandbox.standin import run_standin

    return run_standin(specs, args.policy, not args.no_containers, args.keep_running, nvml_fake=args.nvml_fake)
