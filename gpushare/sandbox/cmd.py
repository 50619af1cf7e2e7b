"""``gpushare sandbox``: a whole cluster with simulated cards on this machine."""

from __future__ import annotations

import argparse
import sys

from gpushare.sandbox.fakenvml import machines as fake_machines
from gpushare.sandbox.nodespec import (
    DEFAULT_NODES,
    DraNode,
    NodeSpec,
    check_dra_nodes,
    check_node_names,
    parse_dra_node,
    parse_node,
)
from gpushare.settings import UsageError, policy_name


def nvml_machine(text: str) -> str:
    """A ``--nvml-fake`` value (argparse type): a shipped machine's name or a description file."""
    from gpushare.sandbox.fakenvml import FakeNvmlError, machine_file

    try:
        machine_file(text)
    except FakeNvmlError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        type=parse_node,
        metavar="NAME=SPEC",
        help="a simulated node, e.g. node-a=2xA100-80GB:81920,1xT4:15360 (repeatable; default: 2 mixed nodes)",
    )
    parser.add_argument(
        "--nvml-fake",
        action="append",
        default=[],
        type=nvml_machine,
        metavar="MACHINE",
        help="a node running 'gpushare node --gpus nvml' on the fake libnvidia-ml presenting MACHINE (a file, "
        f"or one of gpushare/sandbox/fakenvml/machines: {', '.join(fake_machines())}; repeatable; "
        "without --node, only these nodes run)",
    )
    parser.add_argument(
        "--dra-cards",
        action="append",
        default=[],
        type=parse_dra_node,
        metavar="NODE=CARDS",
        help="NODE's agent also serves the DRA driver gpu.gpushare.io with CARDS (all, or card indexes "
        "separated by commas; the others stay with the device plugin), and the DeviceClass gpu.gpushare.io "
        "is applied, so the claims of deploy/examples/dra can run (repeatable; real Kubernetes only)",
    )
    parser.add_argument(
        "--policy", type=policy_name, default=None, help="placement policy for the extender: fgdfit (default), "
        "fgd, binpack or spread",
    )  # fmt: skip
    parser.add_argument("--no-containers", action="store_true", help="don't start real containers even if possible")
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="stay up for kubectl, gpushare inspect and /metrics until Ctrl-C or SIGTERM (without it the "
        "cluster is stopped once the examples are reported)",
    )
    parser.add_argument(
        "--standin",
        action="store_true",
        help="use the API server stand-in and kubelet emulator even where a real Kubernetes can run "
        "(the default is real kube-apiserver, kube-scheduler and kubelets when their binaries are built)",
    )


def run(args: argparse.Namespace) -> int:
    """On a real Kubernetes when it can run here (and ``--standin`` is off), else on the stand-ins.
    SIGTERM and SIGHUP stop it as Ctrl-C does: everything it started is stopped before it exits."""
    from pathlib import Path

    from gpushare.process import Terminated, signals_raise

    # with fake-NVML nodes and no --node, the fake-NVML nodes run alone
    specs = args.node or ([] if args.nvml_fake else [parse_node(n) for n in DEFAULT_NODES])
    names = [s.name for s in specs] + [f"nvml-{Path(m).stem}" for m in args.nvml_fake]
    if reason := check_node_names(names) or check_dra_nodes(args.dra_cards, specs, names):
        raise UsageError(reason)
    if args.nvml_fake:
        from gpushare.sandbox.fakenvml import gcc_missing

        if reason := gcc_missing():
            print(f"gpushare sandbox: --nvml-fake: {reason}", file=sys.stderr)
            return 1
    with signals_raise():
        try:
            return _run(args, specs)
        except Terminated as exc:
            print(f"gpushare sandbox: stopped by {exc}; everything it started is stopped", file=sys.stderr)
            return 128 + exc.signum


def _run(args: argparse.Namespace, specs: list[NodeSpec]) -> int:
    dra: list[DraNode] = args.dra_cards
    reason = "--standin asks for the stand-ins"
    if not args.standin:
        from gpushare.sandbox.realcluster import realcluster_available
        from gpushare.sandbox.realsandbox import run_real

        reason = "--no-containers asks for no containers" if args.no_containers else realcluster_available()
        if reason is None:
            dra_nodes = {d.name: d.cards for d in dra}
            return run_real(specs, args.policy or "", args.keep_running, nvml_fake=args.nvml_fake, dra_nodes=dra_nodes)
        if not dra:
            print(f"gpushare sandbox: using the API stand-in and kubelet emulator: {reason}", file=sys.stderr)
    if dra:  # the stand-ins have no DRA allocator nor kubelet plugin to run a claim
        print(f"gpushare sandbox: --dra-cards needs the real Kubernetes: {reason}", file=sys.stderr)
        return 1
    from gpushare.sandbox.standin import run_standin

    return run_standin(specs, args.policy or "", not args.no_containers, args.keep_running, nvml_fake=args.nvml_fake)
