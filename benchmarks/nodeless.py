"""The real control plane with Node objects but no kubelets, as the scheduling benchmarks use it: nodes as
the advertiser and kubelet would leave them, pods of one run, kube-scheduler with or without the
extender, and the extender as its own process on loopback (plain HTTP)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import yaml
from gpushare.deviceplugin.devices import count_replicas
from kubernetes import client

from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.sandbox.configfiles import SCHEDULER_CONFIG, render_scheduler_config
from gpushare.sandbox.controlplane import SCHEDULER_FEATURE_GATES, scheduler_argv
from gpushare.sandbox.launch import Process, free_port, http_status, wait_for
from gpushare.sandbox.realcluster import RealCluster

NAMESPACE = "default"
#: the label naming the run a benchmark pod belongs to
RUN_LABEL = "gpushare-bench-run"
#: what each benchmark pod asks of the node besides GPUs: little enough never to be what stops a placement
HOST_LIMITS = {"cpu": "100m", "memory": "64Mi"}


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


def create_nodes(core: client.CoreV1Api, pool: ThreadPoolExecutor, nodes: Sequence[tuple[str, str]]) -> None:
    """Nodes ``(name, cards as --gpus sim:... takes them)``, ready for pods."""

    def create(spec: tuple[str, str]) -> None:
        node, status = node_body(*spec)
        core.create_node(node)
        core.patch_node_status(node["metadata"]["name"], status)
        # the API server's admission taints every new node not-ready; kube-controller-manager's
        # node lifecycle controller (off here) would lift it once kubelet reports Ready
        core.patch_node(node["metadata"]["name"], {"spec": {"taints": None}})

    list(pool.map(create, nodes))


def pod_body(name: str, run: str, gpu_limits: Mapping[str, str], claim: str | None = None) -> dict[str, Any]:
    """A busybox pod of ``run`` with ``gpu_limits`` (gpushare's resources), and the ResourceClaim
    ``claim`` for its container when given."""
    container: dict[str, Any] = {
        "name": "main",
        "image": "busybox:1.36",
        "resources": {"limits": {**HOST_LIMITS, **gpu_limits}},
    }
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 0}
    if claim is not None:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        container["resources"]["claims"] = [{"name": "gpu"}]
    return {"metadata": {"name": name, "namespace": NAMESPACE, "labels": {RUN_LABEL: run}}, "spec": spec}


def scheduler_config(cluster: RealCluster, extender_url: str | None, qps: float, host_only: bool = False) -> str:
    """The sandbox's scheduler configuration, without its extender block when ``extender_url`` is None;
    with ``host_only``, only the extender entry that prioritizes every pod (no filter, no bind)."""
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
    elif host_only:
        rendered["extenders"] = [e for e in rendered["extenders"] if "filterVerb" not in e and "bindVerb" not in e]
    return yaml.safe_dump(rendered, sort_keys=False)


def start_scheduler(
    cluster: RealCluster, run: str, config: str, open_paths: Sequence[str] = (),
    feature_gates: Sequence[str] = SCHEDULER_FEATURE_GATES,
) -> tuple[Process, int]:  # fmt: skip
    """kube-scheduler with ``config`` (its file and log named after ``run``) and ``feature_gates`` (those
    gpushare has operators set, unless told), and its secure port."""
    path = cluster.workdir / f"scheduler-{run}.yaml"
    path.write_text(config)
    port = free_port()
    argv = scheduler_argv(path, port, open_paths, feature_gates)
    process = Process(f"kube-scheduler-{run}", argv, cluster.workdir / f"kube-scheduler-{run}.log").start()
    return process, port


def start_extender(
    cluster: RealCluster, name: str, policy: str = "", wrapper: Sequence[str] = (), flags: Sequence[str] = ()
) -> tuple[Process, str]:  # fmt: skip
    """The extender (``policy``, its default if empty; more ``flags``) watching the cluster, once ready,
    and its URL; ``wrapper`` runs it (e.g. ``taskset``)."""
    port = free_port()
    process = Process(
        name,
        [*wrapper, sys.executable, "-m", "gpushare.cli", "extender", "--port", str(port),
         *(["--policy", policy] if policy else []), *flags,
         "--kubeconfig", str(cluster.kubeconfig_of("gpushare-extender"))],
        cluster.workdir / f"{name}.log",
    ).start()  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.check() or http_status(f"{url}/readyz") == 200, 300, "the extender to be ready")
    except BaseException:
        process.stop()
        raise
    return process, url


def delete_run_claims(resource: client.ResourceV1Api, run: str) -> None:
    """Delete the ResourceClaims of ``run`` and wait until they are gone (kube-controller-manager releases
    a claim once its pod is: delete the pods first)."""
    selector = f"{RUN_LABEL}={run}"
    resource.delete_collection_namespaced_resource_claim(NAMESPACE, label_selector=selector)
    wait_for(
        lambda: not resource.list_namespaced_resource_claim(NAMESPACE, label_selector=selector, limit=1).items,
        120,
        f"the ResourceClaims of run {run} to be deleted",
        0.5,
    )


def delete_run_pods(core: client.CoreV1Api, run: str) -> None:
    """Delete the pods of ``run`` at once (no kubelet to wait for) and wait until they are gone."""
    core.delete_collection_namespaced_pod(NAMESPACE, label_selector=f"{RUN_LABEL}={run}", grace_period_seconds=0)
    wait_for(
        lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=f"{RUN_LABEL}={run}", limit=1).items,
        120,
        f"the pods of run {run} to be deleted",
        0.5,
    )
