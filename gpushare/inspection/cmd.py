"""``gpushare inspect [-d] [NODE]``: per-card GPU allocation, read from any cluster's API server.

``kubectl inspect gpushare`` (the ``kubectl-inspect-gpushare`` plugin the original project installed)
runs the same with ``--layout original`` as its default, so that scripts parsing its columns keep
working; ``--layout gpushare`` gives our view there too.
"""

from __future__ import annotations

import argparse
import sys

from gpushare.settings import add_kubeconfig_flag

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
    cluster = views.build_cluster(nodes, pods)
    if args.node and not cluster.nodes:
        print(f"gpushare inspect: node {args.node} has no gpushare GPUs", file=sys.stderr)
        return 1
    if args.layout == "original":
        table = render.render_original_details if args.details else render.render_original_summary
    else:
        table = render.render_details if args.details else render.render_summary
    print(table(cluster))
    return 0
