"""How often a GPU pod bound while kubelet is down fails for good once kubelet is back.

    python benchmarks/kubelet_restart.py [--restarts 20]

Root and the built Kubernetes binaries are needed (see the README). One real cluster with one node
(kubelet, the gpushare node agent, containerd). Each round: kubelet stops; a bare GPU pod
(``aliyun.com/gpu-mem: 2``, no controller to replace it) is created, and either bound while kubelet is
down or held off the node (the node agent says no kubelet watches its device plugin); kubelet starts
again; the round ends when the pod is Running or Failed (kubelet's ``UnexpectedAdmissionError`` when it
admits the pod before the device plugin has registered with it). Prints each failure's reason, the
failure rate and how many pods were held.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from kubernetes import client
from realbench import real_cluster

from gpushare.contract.names import RESOURCE_MEM
from gpushare.sandbox.binaries import KUBE_VERSION
from gpushare.sandbox.launch import wait_for
from gpushare.sandbox.realcluster import as_sandbox_pod

NODE = "node-a"


def manifest(name: str) -> dict[str, Any]:
    return as_sandbox_pod({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "containers": [{"name": "main", "image": "busybox:1.36", "command": ["sleep", "3600"],
                            "resources": {"limits": {RESOURCE_MEM: 2}}}],
        },
    })  # fmt: skip


def decided(core: client.CoreV1Api, name: str) -> str | None:
    """ "bound" once the pod is bound, "held" once kube-scheduler has found no node for it, else None."""
    pod = core.read_namespaced_pod(name, "default")
    if pod.spec.node_name:
        return "bound"
    scheduled = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
    return "held" if scheduled is not None and scheduled.status == "False" else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    failures: list[str] = []
    held = 0
    with real_cluster("gs-restart-", ((NODE, "1xA100-80GB:81920"),)) as cluster:
        core = client.CoreV1Api(cluster.api)
        node = cluster.nodes[NODE]
        for i in range(args.restarts):
            cluster.stop_kubelet(NODE)
            name = f"during-restart-{i}"
            core.create_namespaced_pod("default", manifest(name))
            how = wait_for(lambda n=name: decided(core, n), 60, f"{name} bound or held off the node")
            held += how == "held"
            cluster.start_kubelet(node)

            def settled(n: str = name) -> client.V1Pod | None:
                pod = core.read_namespaced_pod(n, "default")
                return pod if pod.status.phase in ("Running", "Failed") else None

            pod = wait_for(settled, 120, f"{name} Running or Failed", 0.2)
            if pod.status.phase == "Failed":
                failures.append(f"{name}: {pod.status.reason}: {pod.status.message}")
            print(f"restart {i + 1}: {pod.status.phase}", flush=True)
            core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
            wait_for(
                lambda n=name: not core.list_namespaced_pod("default", field_selector=f"metadata.name={n}").items,
                60,
                f"{name} gone",
            )
            cluster.wait_node_ready(node, reported_after=time.time())
    print(f"\nKubernetes {KUBE_VERSION}: {len(failures)} of {args.restarts} GPU pods created while kubelet was "
          f"down failed for good; {held} were held off the node until a kubelet watched its device plugin, "
          f"{args.restarts - held} were bound while it was down")  # fmt: skip
    for failure in failures:
        print(f"  {failure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
