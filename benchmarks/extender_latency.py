"""Extender latency at scale: filter+prioritize per pod over 5,000 nodes x 8 cards, and bind throughput.

Run: python benchmarks/extender_latency.py [--nodes 5000] [--pods 200] [--policy fgd]

Everything goes through the real pieces: nodes and pods live in the API stand-in, the extender watches
them, and every call is an HTTP request with kube-scheduler's JSON (NodeNames mode). After each
pod is scored it is bound, so the cluster fills up as it would in production and the per-node memo
is invalidated for the node that changed.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client

from extender.runtime import start_extender
from gpushare import contract as c
from gpushare.inventory import simulated_cards
from gpushare.kube import load_api
from gpushare.sandbox.apiserver import ApiServer

SHAPES = [(1, 0), (2, 0), (4, 0), (8, 0), (16, 0), (40, 0), (8, 2), (0, 1), (0, 2)]  # (gpu-mem, gpu-count)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def post(url: str, body: object) -> object:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def pod_body(name: str, mem: int, count: int) -> dict:
    limits = {}
    if mem:
        limits[c.RESOURCE_MEM] = str(mem)
    if count:
        limits[c.RESOURCE_COUNT] = str(count)
    return {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits}}]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--binds", type=int, default=200, help="pods for the bind-throughput run")
    parser.add_argument("--policy", default="fgd")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rng = random.Random(7)

    server = ApiServer()
    server.start()
    workdir = Path(tempfile.mkdtemp(prefix="extbench"))
    api = load_api(str(server.write_kubeconfig(workdir / "kubeconfig")))
    core = client.CoreV1Api(api)
    started = time.perf_counter()
    names = [f"node-{i:05d}" for i in range(args.nodes)]
    for name in names:
        cards = simulated_cards(name, "8xA100-80GB:81920")
        annotation = c.format_inventory(cards, c.GIB)
        core.create_node({"metadata": {"name": name, "annotations": {c.NODE_ANN_INVENTORY: annotation}}})
    print(f"created {args.nodes} nodes x 8 cards in {time.perf_counter() - started:.1f}s")

    running = start_extender(api, 0, args.policy, host="127.0.0.1")
    running.cache.wait_synced(120)
    while len(running.cache.node_names()) < args.nodes:
        time.sleep(0.1)
    url = f"http://127.0.0.1:{running.server.port}"

    latencies, filter_only = [], []
    for i in range(args.pods):
        mem, count = rng.choice(SHAPES)
        pod = client.ApiClient().sanitize_for_serialization(
            core.create_namespaced_pod("default", pod_body(f"p{i:04d}", mem, count))
        )
        began = time.perf_counter()
        filtered = post(f"{url}/filter", {"Pod": pod, "NodeNames": names})
        mid = time.perf_counter()
        scores = post(f"{url}/prioritize", {"Pod": pod, "NodeNames": filtered["NodeNames"]})
        latencies.append(time.perf_counter() - began)
        filter_only.append(mid - began)
        best = max(scores, key=lambda s: (s["Score"], s["Host"]))["Host"]
        meta = pod["metadata"]
        reply = post(
            f"{url}/bind", {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": best}
        )
        if reply["Error"]:
            print(f"bind failed: {reply['Error']}", file=sys.stderr)
            return 1

    print(
        f"\nfilter+prioritize over {args.nodes} nodes x 8 cards, {args.pods} pods, "
        f"policy {args.policy} (HTTP, NodeNames)"
    )
    print(f"{'':>22} {'p50 ms':>8} {'p99 ms':>8}")
    for label, samples in (("filter", filter_only), ("filter+prioritize", latencies)):
        print(f"{label:>22} {statistics.median(samples) * 1e3:8.2f} {percentile(samples, 0.99) * 1e3:8.2f}")

    pods = [
        client.ApiClient().sanitize_for_serialization(
            core.create_namespaced_pod("default", pod_body(f"b{i:04d}", 4, 0))
        )
        for i in range(args.binds)
    ]

    def bind(pod: dict, node: str) -> None:
        meta = pod["metadata"]
        reply = post(
            f"{url}/bind", {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": node}
        )
        assert not reply["Error"], reply["Error"]

    half = args.binds // 2
    began = time.perf_counter()
    for pod in pods[:half]:
        bind(pod, "node-00001")
    serial = half / (time.perf_counter() - began)
    lock = threading.Lock()
    spread = iter(names[2:])
    began = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        for pod in pods[half:]:
            with lock:
                node = next(spread)
            pool.submit(bind, pod, node)
    parallel = (args.binds - half) / (time.perf_counter() - began)
    print(
        f"\nbind throughput: {serial:.1f} binds/s onto one node (serialised by its lock), "
        f"{parallel:.1f} binds/s with 8 concurrent binds onto different nodes"
    )
    running.stop()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
