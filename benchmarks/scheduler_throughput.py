"""Pods bound per second by the real kube-scheduler, alone and with the gpushare extender.

    python benchmarks/scheduler_throughput.py [--nodes 1000] [--pods 800] [--rounds 3] [--qps 1000]
                                              [--gpus 4xA100-80GB:81920]

Root and the built Kubernetes binaries are needed (see the README). One etcd and kube-apiserver serve
every round; no kubelets run: the nodes are Node objects carrying the advertiser's inventory annotation
and, in their status, what kubelet and the device plugin would report (cpu, memory, pods,
``aliyun.com/gpu-mem`` in units, ``aliyun.com/gpu-count`` as one replica per unit of each card). The
extender runs as its own process on loopback (plain HTTP) for the whole run, watching the cluster.

Each round measures both setups, the order alternating from round to round: the pods are created
first, then kube-scheduler starts (with ``deploy/scheduler-config.yaml``'s extender block, or with no
extender), and the rate is the pods bound after the first one over the time from the first binding
to the last, as a watch in this script sees them. The scheduler is then stopped and the pods deleted.
Both setups give kube-scheduler the same client rate limit (``clientConnection.qps`` and ``burst``,
``--qps``): at its default of 50 requests/s the plain scheduler's own binding calls are what limits it.
kube-controller-manager runs without its node lifecycle controller: no kubelet heartbeats these nodes, so
it would otherwise mark them unreachable mid-run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import yaml
from gpushare.deviceplugin.devices import count_replicas
from kubernetes import client
from realbench import real_cluster

from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import ANN_ALLOCATION, NODE_ANN_INVENTORY, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import GIB
from gpushare.inventory import simulated_cards
from gpushare.kube.watch import WatchCache
from gpushare.sandbox.binaries import KUBE_VERSION
from gpushare.sandbox.realcluster import (
    SCHEDULER_CONFIG,
    ClusterError,
    Process,
    RealCluster,
    _get,
    free_port,
    render_scheduler_config,
    scheduler_argv,
    wait_for,
)

NAMESPACE = "default"
RUN_LABEL = "gpushare-bench-run"
#: (gpu-mem, gpu-count) the pods ask for, in turn: mostly shared cards, a few two-card pods
SHAPES = ((1, 0), (2, 0), (4, 0), (8, 0), (2, 0), (16, 0), (8, 2), (4, 0))
BIND_TIMEOUT = 600.0
SETUPS = ("scheduler alone", "with extender")


def node_body(name: str, gpus: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A node as the advertiser and kubelet (with the device plugin registered) leave it: the object,
    then its status."""
    cards = simulated_cards(name, gpus)
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        RESOURCE_MEM: str(sum(GIB.units_of(card.memory_mib) for card in cards)),
        RESOURCE_COUNT: str(sum(count_replicas(card, GIB) for card in cards)),
    }
    node = {
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name},
            "annotations": {NODE_ANN_INVENTORY: format_inventory(cards, GIB)},
        }
    }
    status = {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "benchmark node"}],
    }
    return node, {"status": status}


def pod_body(name: str, run: str, shape: tuple[int, int]) -> dict[str, Any]:
    mem, count = shape
    limits = {"cpu": "100m", "memory": "64Mi"}
    if mem:
        limits[RESOURCE_MEM] = str(mem)
    if count:
        limits[RESOURCE_COUNT] = str(count)
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {RUN_LABEL: run}},
        "spec": {
            "containers": [{"name": "main", "image": "busybox:1.36", "resources": {"limits": limits}}],
            "terminationGracePeriodSeconds": 0,
        },
    }


def scheduler_config(cluster: RealCluster, extender_url: str | None, qps: float) -> str:
    """The sandbox's scheduler configuration, without its extender block when ``extender_url`` is None."""
    rendered = yaml.safe_load(
        render_scheduler_config(
            cluster.kubeconfig_of("system:kube-scheduler"),
            extender_url or "http://127.0.0.1:1",
            "default-scheduler",
            yaml.safe_load(SCHEDULER_CONFIG.read_text()),
            client_rate=(qps, int(qps)),
        )
    )
    if extender_url is None:
        del rendered["extenders"]
    return yaml.safe_dump(rendered, sort_keys=False)


class BindTimes:
    """When each pod of one run was first seen bound, from a watch."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, _kind: str, pod: dict[str, Any]) -> None:
        if (pod.get("spec") or {}).get("nodeName"):
            with self._lock:
                self.times.setdefault(pod["metadata"]["name"], time.monotonic())

    def count(self) -> int:
        with self._lock:
            return len(self.times)

    def rate(self) -> float:
        stamps = sorted(self.times.values())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def run_once(
    cluster: RealCluster, core: client.CoreV1Api, pool: ThreadPoolExecutor, args: argparse.Namespace, run: str,
    extender_url: str | None,
) -> float:  # fmt: skip
    """Create the pods, start kube-scheduler, wait for every binding; pods bound per second."""
    names = [f"{run}-{i:04d}" for i in range(args.pods)]
    list(pool.map(lambda i: core.create_namespaced_pod(NAMESPACE, pod_body(names[i], run, SHAPES[i % len(SHAPES)])),
                  range(args.pods)))  # fmt: skip
    bound = BindTimes()
    watch = WatchCache(cluster.api, "pods", label_selector=f"{RUN_LABEL}={run}")
    watch.add_listener(bound)
    watch.start()
    watch.wait_synced(60)
    config = cluster.workdir / f"scheduler-{run}.yaml"
    config.write_text(scheduler_config(cluster, extender_url, args.qps))
    scheduler = Process(
        f"kube-scheduler-{run}", scheduler_argv(config, free_port()), cluster.workdir / f"kube-scheduler-{run}.log"
    ).start()
    try:
        wait_for(
            lambda: scheduler.check() or bound.count() == args.pods,
            BIND_TIMEOUT,
            f"{args.pods} bindings in run {run} ({bound.count()} seen; log {scheduler.log_path})",
            0.2,
        )
    finally:
        scheduler.stop()
        watch.stop()
    if extender_url is not None:
        placed = [p for p in core.list_namespaced_pod(NAMESPACE, label_selector=f"{RUN_LABEL}={run}").items
                  if ANN_ALLOCATION in (p.metadata.annotations or {})]  # fmt: skip
        if len(placed) != args.pods:
            raise ClusterError(f"run {run}: only {len(placed)} of {args.pods} pods carry the extender's allocation")
    core.delete_collection_namespaced_pod(NAMESPACE, label_selector=f"{RUN_LABEL}={run}", grace_period_seconds=0)
    wait_for(
        lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=f"{RUN_LABEL}={run}", limit=1).items,
        120,
        f"the pods of run {run} to be deleted",
        0.5,
    )
    return bound.rate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpus", default="4xA100-80GB:81920", help="every node's cards, as --gpus sim:... takes them")
    parser.add_argument(
        "--qps", type=float, default=1000.0, help="kube-scheduler's client qps and burst, in both setups"
    )
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs) afterwards")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with real_cluster(
        "gs-tput-", (), args.keep, scheduler_names=(), controllers=("*", "-node-lifecycle-controller")
    ) as cluster:
        core = client.CoreV1Api(cluster.api)
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:

            def create(i: int) -> None:
                node, status = node_body(f"node-{i:04d}", args.gpus)
                core.create_node(node)
                core.patch_node_status(node["metadata"]["name"], status)
                # the API server's admission taints every new node not-ready; kube-controller-manager's
                # node lifecycle controller (off here) would lift it once kubelet reports Ready
                core.patch_node(node["metadata"]["name"], {"spec": {"taints": None}})

            list(pool.map(create, range(args.nodes)))
            print(f"{args.nodes} nodes ({args.gpus}) created in {time.monotonic() - started:.0f}s", flush=True)
            port = free_port()
            extender = Process(
                "extender",
                [sys.executable, "-m", "gpushare.cli", "extender", "--port", str(port),
                 "--kubeconfig", str(cluster.kubeconfig_of("gpushare-extender"))],
                cluster.workdir / "extender.log",
            ).start()  # fmt: skip
            try:
                url = f"http://127.0.0.1:{port}"
                wait_for(lambda: extender.check() or _get(f"{url}/readyz") == 200, 120, "the extender to be ready")
                rates: dict[str, list[float]] = {setup: [] for setup in SETUPS}
                for round_ in range(args.rounds):
                    order = SETUPS if round_ % 2 == 0 else SETUPS[::-1]
                    for setup in order:
                        via = url if setup == SETUPS[1] else None
                        rate = run_once(cluster, core, pool, args, f"r{round_}-{'ext' if via else 'plain'}", via)
                        rates[setup].append(rate)
                        print(f"round {round_ + 1}: {setup}: {rate:.1f} pods/s", flush=True)
            finally:
                extender.stop()
    alone, ext = (statistics.median(rates[s]) for s in SETUPS)
    print(
        f"\nKubernetes {KUBE_VERSION}, client qps/burst {args.qps:g} in both setups\n"
        f"{args.nodes} nodes, {args.pods} pods, {args.rounds} rounds (medians): "
        f"scheduler alone {alone:.1f} pods/s, with extender {ext:.1f} pods/s: {100 * ext / alone:.0f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
