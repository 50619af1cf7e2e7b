"""Create → Running for a GPU pod against the same pod without a GPU, on the real cluster.

    python benchmarks/pod_startup.py [--pods 10]

Root and the built Kubernetes binaries are needed (see the README). One real cluster (etcd,
kube-apiserver, kube-controller-manager, kube-scheduler with the gpushare extender over mutual TLS, and one
node: containerd behind the gpushare CRI shim, the node agent and kubelet) serves every pod. The two kinds
alternate, one pod at a time, so both see the same machine: a busybox pod asking for
``aliyun.com/gpu-mem: 1`` (filter, prioritize and bind by the extender, Allocate by the device plugin,
CreateContainer checked by the shim) and the same pod asking for nothing (kube-scheduler binds it itself;
the extender's second entry still scores it). The time is from the create call returning to a pod watch
showing phase Running; each pod is deleted, and gone, before the next is created.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import threading
import time
from typing import Any

from kubernetes import client
from realbench import real_cluster

from gpushare.contract.names import RESOURCE_MEM
from gpushare.kube.watch import WatchCache
from gpushare.sandbox.binaries import KUBE_VERSION
from gpushare.sandbox.launch import wait_for
from gpushare.sandbox.realcluster import as_sandbox_pod

NAMESPACE = "default"
LABEL = "gpushare-bench-startup"
KINDS = ("GPU pod (gpu-mem: 1)", "same pod without a GPU")


class RunningTimes:
    """When each pod was first seen Running, from a watch."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.seen = threading.Condition()

    def __call__(self, _kind: str, pod: dict[str, Any]) -> None:
        if (pod.get("status") or {}).get("phase") == "Running":
            with self.seen:
                self.times.setdefault(pod["metadata"]["name"], time.monotonic())
                self.seen.notify_all()

    def wait(self, name: str, timeout: float) -> float:
        with self.seen:
            if not self.seen.wait_for(lambda: name in self.times, timeout):
                raise TimeoutError(f"pod {name} not Running within {timeout:.0f}s")
            return self.times[name]


def manifest(name: str, gpu: bool) -> dict[str, Any]:
    limits = {RESOURCE_MEM: 1} if gpu else {}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {LABEL: "yes"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "main", "image": "busybox:1.36", "command": ["sleep", "3600"], "resources": {"limits": limits}}
            ],
        },
    }
    return as_sandbox_pod(pod)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=10, help="pods of each kind")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs) afterwards")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with real_cluster("gs-start-", (("node-a", "2xA100-80GB:81920"),), args.keep) as cluster:
        core = client.CoreV1Api(cluster.api)
        running = RunningTimes()
        watch = WatchCache(cluster.api, "pods", label_selector=f"{LABEL}=yes")
        watch.add_listener(running)
        watch.start()
        try:
            watch.wait_synced(60)
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for i in range(args.pods):
                order = KINDS if i % 2 == 0 else KINDS[::-1]
                for kind in order:
                    name = f"{'gpu' if kind == KINDS[0] else 'plain'}-{i}"
                    core.create_namespaced_pod(NAMESPACE, manifest(name, kind == KINDS[0]))
                    created = time.monotonic()
                    times[kind].append(running.wait(name, 120) - created)
                    core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
                    wait_for(
                        lambda n=name: (
                            not core.list_namespaced_pod(NAMESPACE, field_selector=f"metadata.name={n}").items
                        ),
                        60,
                        f"pod {name} to be gone",
                        0.1,
                    )
        finally:
            watch.stop()
    gpu, plain = (statistics.median(times[kind]) for kind in KINDS)
    print(f"Kubernetes {KUBE_VERSION}, {args.pods} pods of each kind, create -> Running (median)")
    for kind in KINDS:
        each = ", ".join(f"{t:.2f}" for t in times[kind])
        print(f"  {kind:<24} {statistics.median(times[kind]):6.2f} s   (all: {each})")
    print(f"  ratio GPU / no GPU        {gpu / plain:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
