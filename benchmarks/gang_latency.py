"""What one large gang costs the extender: its members' filters, and other pods' filters meanwhile.

    python benchmarks/gang_latency.py [--nodes 100] [--members 1000] [--gib 4] [--samples 200]

As deployed (``gpushare apiserver`` and ``gpushare extender`` as separate processes, the verbs over HTTP
in NodeNames mode). A gang of ``--members`` pending pods of ``--gib`` GiB each is created over ``--nodes``
nodes of 8 x 80 GiB cards. Reported, in milliseconds:

- other pods' filters with no gang filter running (the baseline);
- the gang's first filter (it plans every member and writes the holds on every node it uses);
- the members' filters afterwards, each member in turn, as kube-scheduler retries them;
- other pods' filters while a second connection filters the gang's members without pause.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from extender_latency import CARD_UNITS, Verbs, free_port, pending, pod_body, ready, report, serve, wait_for
from kubernetes import client

from gpushare.contract.gang import format_gang
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.kube.objects import get_pod
from gpushare.kube.transport import load_api


def filter_time(verbs: Verbs, pod: dict[str, Any], names: list[str]) -> tuple[float, list[str]]:
    reply, spent = verbs.exchange("filter", json.dumps({"Pod": pod, "NodeNames": names}).encode())
    return spent, json.loads(reply)["NodeNames"]


def others(verbs: Verbs, pods: list[dict[str, Any]], names: list[str]) -> list[float]:
    return [filter_time(verbs, pod, names)[0] for pod in pods]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--gib", type=int, default=4, help="GiB per member")
    parser.add_argument("--samples", type=int, default=200, help="other pods' filters per measurement")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gangbench")))
        kubeconfig = workdir / "kubeconfig"
        serve(stack, workdir / "apiserver.log", "apiserver", "--port", str(free_port()), "--kubeconfig-out", kubeconfig)
        wait_for(kubeconfig.exists, "the API stand-in to write its kubeconfig")
        api = load_api(str(kubeconfig))
        core = client.CoreV1Api(api)
        names = [f"node-{i:04d}" for i in range(args.nodes)]
        for name in names:
            cards = simulated_cards(name, f"8xA100-80GB:{CARD_UNITS * 1024}")
            annotations = {NODE_ANN_INVENTORY: format_inventory(cards, GIB)}
            core.create_node({"metadata": {"name": name, "annotations": annotations}})

        def member(i: int) -> None:
            body = pod_body(f"m{i:05d}", args.gib, 0)
            body["metadata"]["labels"] = format_gang("big", args.members)
            core.create_namespaced_pod("default", body)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(member, range(args.members)))
        port = free_port()
        serve(stack, workdir / "extender.log", "extender", "--port", str(port), "--kubeconfig", kubeconfig)
        wait_for(lambda: ready(port), "the extender to become ready")
        verbs = Verbs(port)
        members = [get_pod(api, "default", f"m{i:05d}") for i in range(args.members)]
        small = [pending(api, core, f"s{i:04d}", (args.gib, 0)) for i in range(args.samples)]
        return measure(args, port, verbs, members, small, names)


def measure(
    args: argparse.Namespace,
    port: int,
    verbs: Verbs,
    members: list[dict[str, Any]],
    small: list[dict[str, Any]],
    names: list[str],
) -> int:
    others(verbs, small[:10], names)  # the shape's first answer is not what is measured
    baseline = others(verbs, small, names)
    first, passing = filter_time(verbs, members[0], names)
    if len(passing) != 1:
        print(f"the gang's first member was not placed: {passing}", file=sys.stderr)
        return 1
    warm = [filter_time(verbs, pod, names)[0] for pod in members[1:]]
    stop = threading.Event()
    background = Verbs(port)

    def churn() -> None:
        while not stop.is_set():
            for pod in members:
                if stop.is_set():
                    return
                filter_time(background, pod, names)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        loaded = others(verbs, small, names)
    finally:
        stop.set()
        thread.join()
    print(
        f"\n{args.nodes} nodes x 8 cards, one gang of {args.members} members of {args.gib} GiB (HTTP, NodeNames mode)"
    )
    print(f"{'':>20} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    report(f"other pods, no gang filter ({len(baseline)})", baseline)
    report("gang's first filter (1)", [first])
    report(f"members' filters after it ({len(warm)})", warm)
    report(f"other pods, gang filters running ({len(loaded)})", loaded)
    print(f"\nother pods' median filter: {statistics.median(loaded) / statistics.median(baseline):.2f}x the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
