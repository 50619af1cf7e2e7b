"""``gpushare inspect [-d] [NODE]``: per-card GPU allocation, read from any cluster's API server: the
device plugin's cards from nodes and pods, the DRA driver's from ResourceSlices and ResourceClaims.

``kubectl inspect gpushare`` (the ``kubectl-inspect-gpushare`` plugin the original project installed)
runs the same with ``--layout original`` as its default, so that scripts parsing its columns keep
working; ``--layout gpushare`` gives our view there too.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from gpushare.contract.names import DRA_API_VERSION, DRA_DRIVER
from gpushare.settings import add_kubeconfig_flag

if TYPE_CHECKING:
    from kubernetes import client

    from gpushare.inspection.dra import DraCards

LAYOUTS = ("gpushare", "original")


def add_arguments(parser: argparse.ArgumentParser, layout: str = "gpushare") -> None:
    parser.add_argument("-d", "--details", action="store_true", help="list every pod with its units on each card")
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=layout,
        help="gpushare: each node in its own unit, with health, over-commitment and notes; original: the "
        f"columns and totals lines of the original kubectl-inspect-gpushare (default: {layout})",
    )
    parser.add_argument("node", nargs="?", default=None, metavar="NODE", help="show only this node")
    add_kubeconfig_flag(parser)


def read_dra(api: client.ApiClient, node: str | None) -> tuple[DraCards | None, str | None]:
    """The DRA driver's slices and the claims allocated from them (``node``'s only, when given), or None
    and why they can't be read: a cluster without resource.k8s.io/v1, or RBAC that doesn't let us list them."""
    from gpushare.inspection.dra import dra_cards
    from gpushare.kube.errors import KubeError, KubeNotFound
    from gpushare.kube.objects import list_resource_claims, list_resource_slices

    selector = f"spec.driver={DRA_DRIVER}" + (f",spec.nodeName={node}" if node else "")
    try:
        cards = dra_cards(list_resource_slices(api, selector), list_resource_claims(api))
    except KubeNotFound:
        return None, f"the API server serves no {DRA_API_VERSION}"
    except KubeError as exc:
        return None, str(exc)
    return (cards.of_node(node) if node else cards), None


def run(args: argparse.Namespace) -> int:
    from gpushare.inspection import render, views
    from gpushare.kube.errors import KubeError
    from gpushare.kube.objects import get_node, list_nodes, list_pods
    from gpushare.kube.transport import load_api

    try:
        api = load_api(args.kubeconfig)
        if args.node:
            nodes = [get_node(api, args.node)]
            pods = list_pods(api, field_selector=f"spec.nodeName={args.node}")
        else:
            nodes = list_nodes(api)
            pods = list_pods(api)
    except KubeError as exc:
        print(f"gpushare inspect: {exc}", file=sys.stderr)
        return 1
    dra, why_not = read_dra(api, args.node)
    if why_not:
        print(f"gpushare inspect: cards of the DRA driver {DRA_DRIVER} not shown: {why_not}", file=sys.stderr)
    cluster = views.build_cluster(nodes, pods, dra)
    if args.node and not cluster.nodes:
        print(f"gpushare inspect: node {args.node} has no gpushare GPUs", file=sys.stderr)
        return 1
    if args.layout == "original":
        table = render.render_original_details if args.details else render.render_original_summary
    else:
        table = render.render_details if args.details else render.render_summary
    print(table(cluster))
    return 0
