"""gpushare installed the way docs/operations.md tells an operator to, on a real Kubernetes v1.37 cluster
(:class:`~gpushare.sandbox.shippedcluster.ShippedCluster`): the image built here in each node's
containerd, ``helm install`` of deploy/helm/gpushare, each kubelet pointed at its node agent's CRI shim,
kube-scheduler configured from the chart's ConfigMap; then the example pods, ``helm upgrade`` to
another policy while GPU pods are being placed, a DRA claim on the card of each node offered through
DRA, and ``helm uninstall``, after which the cluster holds what the guide says it holds and nothing
more.

Every step is the guide's own commands (:mod:`support.guide`). The tests run in file order, each on what
the ones before it did, on one cluster: two nodes with simulated cards behind the fake NVML driver, one a
mixed machine and one a DGX A100.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from support.cards import assert_sees_assigned_cards
from support.guide import Guide, guide_steps, workspace
from support.waiting import wait_until

from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.names import ENV_VISIBLE_DEVICES, NODE_ANN_INVENTORY, RESOURCE_MEM, VISIBLE_DEVICES_VOID
from gpushare.kube.objects import get_pod
from gpushare.sandbox import image
from gpushare.sandbox.examples import load_examples
from gpushare.sandbox.realcluster import as_sandbox_pod
from gpushare.sandbox.shippedcluster import SCHEDULER_CONFIG, ShippedCluster, shipped_cluster_available
from gpushare.usage import node_usage

UNAVAILABLE = shipped_cluster_available() or image.missing()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no Helm install here: {UNAVAILABLE}")

NODES = (("node-a", "mixed"), ("node-b", "dgx-a100"))
NAMESPACE = "gpushare-system"
#: the tests' values file. Besides the guide's image, it points the chart at the fake driver where the
#: GPU operator puts the driver's library (the nodes' machines bind it there), turns on both
#: admission guards, so that the webhook runs as a Deployment too, and offers card 1 of each node
#: through DRA (docs/operations.md, "Dynamic Resource Allocation"), the others through the device
#: plugin. The image is the one imported into each node's containerd: there is no registry here.
VALUES = {
    "image": {"repository": "gpushare"},
    "nodeAgent": {"nvmlLibrary": "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"},
    "admission": "both",
    "dra": {"enabled": True, "cards": "1"},
}
#: the example pods that run (too-big stays Pending by design)
RUNNING_EXAMPLES = ("multi-container", "shared-1", "shared-2", "two-cards", "a100-only", "nvlink-pair")
#: at most this many GPU pods are created, one a second, while the upgrade rolls the extender
DURING_UPGRADE = 12
POD_TIMEOUT = 90.0
API_POLL = 0.2


@dataclass
class Installed:
    """The cluster, the guide run on it, and what the tests saw before anything was installed."""

    cluster: ShippedCluster
    guide: Guide
    core: client.CoreV1Api
    #: per node: its labels and annotations before the install
    nodes_before: dict[str, tuple[dict[str, str], dict[str, str]]] = field(default_factory=dict)
    #: cluster-scoped objects by kind, and namespaces, before the install
    cluster_before: dict[str, set[str]] = field(default_factory=dict)
    pods: list[str] = field(default_factory=list)

    def pod(self, name: str) -> dict[str, Any]:
        return get_pod(self.cluster.api, "default", name)

    def create(self, manifest: dict[str, Any]) -> str:
        self.core.create_namespaced_pod("default", as_sandbox_pod(manifest))
        self.pods.append(manifest["metadata"]["name"])
        return manifest["metadata"]["name"]

    def inventory(self, node: str) -> NodeInventory:
        annotations = self.core.read_node(node).metadata.annotations or {}
        return parse_inventory(annotations.get(NODE_ANN_INVENTORY, ""), node)

    def wait_running(self, name: str) -> dict[str, Any]:
        def running() -> dict[str, Any] | None:
            pod = self.pod(name)
            status = pod.get("status") or {}
            assert status.get("phase") != "Failed", f"pod {name} failed: {status.get('message')}"
            return pod if status.get("phase") == "Running" else None

        return wait_until(running, POD_TIMEOUT, f"pod {name} to run", API_POLL)

    def assert_sees_its_cards(self, name: str) -> None:
        pod = self.pod(name)
        node = self.cluster.nodes[pod["spec"]["nodeName"]]
        assert_sees_assigned_cards(
            pod, self.inventory(node.name), lambda container: node.container_env("default", name, container)
        )


def cluster_scoped(api: Any) -> dict[str, set[str]]:
    rbac, admission = client.RbacAuthorizationV1Api(api), client.AdmissionregistrationV1Api(api)
    return {
        "namespaces": {n.metadata.name for n in client.CoreV1Api(api).list_namespace().items},
        "clusterroles": {r.metadata.name for r in rbac.list_cluster_role().items},
        "clusterrolebindings": {b.metadata.name for b in rbac.list_cluster_role_binding().items},
        "validatingwebhookconfigurations": {
            w.metadata.name for w in admission.list_validating_webhook_configuration().items
        },
        "validatingadmissionpolicies": {p.metadata.name for p in admission.list_validating_admission_policy().items},
        "validatingadmissionpolicybindings": {
            b.metadata.name for b in admission.list_validating_admission_policy_binding().items
        },
    }


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    workdir = Path(tempfile.mkdtemp(prefix="gs-helm-", dir="/tmp"))
    cluster = ShippedCluster(NODES, workdir, images=[image.built()])
    try:
        cluster.start()
        cwd = workspace(workdir / "checkout")
        (cwd / "my-values.yaml").write_text(yaml.safe_dump(VALUES))
        core = client.CoreV1Api(cluster.api)
        state = Installed(cluster, Guide(cluster, cwd), core)
        for node in core.list_node().items:
            state.nodes_before[node.metadata.name] = (dict(node.metadata.labels), dict(node.metadata.annotations))
        state.cluster_before = cluster_scoped(cluster.api)
        yield state
    finally:
        cluster.stop()
        remove_tree(workdir)


def remove_tree(path: Path) -> None:
    """Remove the cluster's directory; the kernel may still be releasing the last mounts of its machines'
    namespaces for a moment after their processes have ended."""

    def removed() -> bool:
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()

    wait_until(removed, 10, f"{path} to be removed", API_POLL)


def test_helm_install_runs_every_part_as_a_pod(installed: Installed) -> None:
    guide, core = installed.guide, installed.core
    guide.run("label")
    guide.run("install")
    pods = core.list_namespaced_pod(NAMESPACE).items
    agents = {p.spec.node_name: p for p in pods if p.metadata.name.startswith("gpushare-node-agent-")}
    assert set(agents) == set(installed.cluster.nodes)
    for agent in agents.values():
        assert agent.spec.host_network and agent.spec.containers[0].security_context.privileged
        mounts = {m.mount_path for m in agent.spec.containers[0].volume_mounts}
        assert {"/var/lib/kubelet/device-plugins", "/run/containerd", "/run/gpushare"} <= mounts
    for prefix in ("gpushare-extender-", "gpushare-webhook-"):
        replicas = [p for p in pods if p.metadata.name.startswith(prefix)]
        assert [all(c.ready for c in p.status.container_statuses) for p in replicas] == [True, True]
    # each agent read its node's cards through the driver library the chart mounts: card 1 is DRA's
    assert [c.index for c in installed.inventory("node-a").cards] == [0, 2, 3]
    assert {c.model for c in installed.inventory("node-b").cards} == {"NVIDIA A100-SXM4-80GB"}


def test_kubelet_talks_to_the_shim_as_the_guide_says(installed: Installed) -> None:
    guide, cluster = installed.guide, installed.cluster
    guide.run("agent-ready")
    output = guide.run("kubelet-to-shim")
    assert "RuntimeName:  containerd" in output, output
    guide.run("node-ready")
    for node in cluster.nodes.values():
        config = yaml.safe_load((node.kubelet_dir / "config.yaml").read_text())
        assert config["containerRuntimeEndpoint"] == config["imageServiceEndpoint"] == "unix:///run/gpushare/cri.sock"

    def offers_gpu_mem() -> bool:
        return all(
            int((n.status.allocatable or {}).get(RESOURCE_MEM, "0")) > 0 for n in installed.core.list_node().items
        )

    # the device plugin registered again with the restarted kubelet
    wait_until(offers_gpu_mem, 60, f"every node to offer {RESOURCE_MEM}", API_POLL)


def test_kube_scheduler_reads_the_charts_configuration(installed: Installed) -> None:
    installed.guide.run("scheduler-files")
    config_file = installed.cluster.workdir / "etc-kubernetes" / SCHEDULER_CONFIG.name
    config = yaml.safe_load(config_file.read_text())
    service = installed.core.read_namespaced_service("gpushare-extender", NAMESPACE)
    assert {e["urlPrefix"] for e in config["extenders"]} == {f"https://{service.spec.cluster_ip}:32766"}
    assert {e["tlsConfig"]["serverName"] for e in config["extenders"]} == {f"gpushare-extender.{NAMESPACE}.svc"}
    installed.cluster.restart_scheduler(SCHEDULER_CONFIG)


def test_the_examples_run_with_the_cards_the_scheduler_wrote(installed: Installed) -> None:
    installed.guide.run("check")
    installed.pods.append("shared-1")
    for manifest in load_examples():
        if manifest["metadata"]["name"] != "shared-1":
            installed.create(manifest)
    for name in RUNNING_EXAMPLES:
        installed.wait_running(name)
        installed.assert_sees_its_cards(name)
    installed.wait_running("no-gpu-all-devices")
    node = installed.cluster.nodes[installed.pod("no-gpu-all-devices")["spec"]["nodeName"]]
    # only the CRI shim hides the cards from a pod that asks for none
    assert node.container_env("default", "no-gpu-all-devices", "main")[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID


def gpu_pod(name: str, mem: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "busybox:1.36",
                    "command": ["sleep", "3600"],
                    "resources": {"limits": {RESOURCE_MEM: mem}},
                }
            ],
        },
    }


def test_helm_upgrade_rolls_the_extender_with_no_pod_bound_wrongly(installed: Installed) -> None:
    core, apps = installed.core, client.AppsV1Api(installed.cluster.api)
    kept = {name: core.read_namespaced_secret(name, NAMESPACE).data for name in ("gpushare-ca", "gpushare-client-ca")}
    old = {p.metadata.name for p in core.list_namespaced_pod(NAMESPACE).items if "extender" in p.metadata.name}
    made: list[str] = []
    stop = threading.Event()

    def keep_creating() -> None:
        for i in range(DURING_UPGRADE):
            if stop.wait(1.0):
                return
            made.append(installed.create(gpu_pod(f"during-upgrade-{i}", 4 + i % 3 * 4)))

    creator = threading.Thread(target=keep_creating)
    creator.start()
    try:
        installed.guide.run("upgrade")
        rolled = datetime.now(UTC)
    finally:
        stop.set()
        creator.join()
    # scheduling went on while the replicas were replaced
    assert any(scheduled_at(installed.pod(name)) <= rolled for name in made), "no GPU pod was placed during the upgrade"

    def extenders() -> list[Any]:
        return [p for p in core.list_namespaced_pod(NAMESPACE).items if "extender" in p.metadata.name]

    # --wait returns once the new replicas are ready; the old ones end within their grace period
    wait_until(
        lambda: not {p.metadata.name for p in extenders()} & old, 60, "the old extender replicas to end", API_POLL
    )
    for pod in extenders():
        assert "--policy=binpack" in pod.spec.containers[0].args
    assert apps.read_namespaced_deployment("gpushare-extender", NAMESPACE).status.ready_replicas == 2
    assert {name: core.read_namespaced_secret(name, NAMESPACE).data for name in kept} == kept
    # pods placed after the upgrade reach the new replicas with the files kube-scheduler already had
    made.append(installed.create(gpu_pod("after-upgrade", 4)))
    for name in made:
        installed.wait_running(name)
        installed.assert_sees_its_cards(name)
    assert_no_card_over_committed(installed)


def scheduled_at(pod: dict[str, Any]) -> datetime:
    """When the pod was bound (the end of time while it isn't)."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "True":
            return datetime.fromisoformat(condition["lastTransitionTime"])
    return datetime.max.replace(tzinfo=UTC)


def assert_no_card_over_committed(installed: Installed) -> None:
    """What the pods hold on each card, counted by the rule every component counts by, fits the card;
    and no pod's annotations are wrong."""
    for node in installed.cluster.nodes:
        inventory = installed.inventory(node)
        pods = [installed.pod(p.metadata.name) for p in installed.core.list_namespaced_pod(
            "default", field_selector=f"spec.nodeName={node}").items]  # fmt: skip
        used, _, bad = node_usage(pods, inventory)
        assert not bad, f"node {node}: {bad}"
        over = {c.uuid: used[c.uuid] for c in inventory.cards if used[c.uuid] > inventory.units_of(c)}
        assert not over, f"node {node}: cards holding more than they have: {over}"


def test_a_claim_gets_card_1_which_each_node_offers_through_dra_alone(installed: Installed) -> None:
    core, resource = installed.core, client.ResourceV1Api(installed.cluster.api)

    def every_slice() -> list[Any] | None:
        items = resource.list_resource_slice().items
        return items if len(items) == len(installed.cluster.nodes) else None

    listed = wait_until(every_slice, 60, "each node's ResourceSlice", API_POLL)
    assert {s.spec.node_name: [d.name for d in s.spec.devices or []] for s in listed} == {
        node: ["card-1"] for node in installed.cluster.nodes
    }
    card_1 = {s.spec.node_name: s.spec.devices[0].attributes["uuid"].string for s in listed}
    for node in installed.cluster.nodes:
        assert card_1[node] not in {c.uuid for c in installed.inventory(node).cards}
        units = sum(installed.inventory(node).units_of(c) for c in installed.inventory(node).cards)
        assert int(core.read_node(node).status.allocatable[RESOURCE_MEM]) == units

    output = installed.guide.run("dra-claim")
    installed.pods.append("dra-memory-8gi")
    pod = installed.pod("dra-memory-8gi")
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = resource.read_namespaced_resource_claim(status["resourceClaimName"], "default")
    (result,) = claim.status.allocation.devices.results
    assert (result.driver, result.pool, result.device) == ("gpu.gpushare.io", pod["spec"]["nodeName"], "card-1")
    node = installed.cluster.nodes[pod["spec"]["nodeName"]]
    env = node.container_env("default", "dra-memory-8gi", "main")
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "1" and env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "8", env
    assert env[ENV_VISIBLE_DEVICES] == card_1[node.name]
    assert "(DRA)" in output and "dra-memory-8gi condition met" in output, output


def test_helm_uninstall_leaves_what_the_guide_says(installed: Installed) -> None:
    guide, core, cluster = installed.guide, installed.core, installed.cluster
    for name in installed.pods:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    cluster.restart_scheduler(None)  # step 1: kube-scheduler back to its own configuration
    guide.run("scheduler-files-removed")
    assert not (cluster.workdir / "etc-kubernetes" / "gpushare").exists()
    guide.run("kubelet-to-containerd")
    for node in cluster.nodes.values():
        config = yaml.safe_load((node.kubelet_dir / "config.yaml").read_text())
        assert config["containerRuntimeEndpoint"] == "unix:///run/containerd/containerd.sock"
        assert "imageServiceEndpoint" not in config
    guide.run("uninstall")
    left = {s.metadata.name for s in core.list_namespaced_secret(NAMESPACE).items}
    assert left == {"gpushare-ca", "gpushare-client-ca"}
    # the workloads' pods end within their grace period, after helm has deleted their owners
    wait_until(lambda: not core.list_namespaced_pod(NAMESPACE).items, 60, f"the pods of {NAMESPACE} to end", API_POLL)
    assert [c.metadata.name for c in core.list_namespaced_config_map(NAMESPACE).items] == ["kube-root-ca.crt"]
    slices = client.ResourceV1Api(cluster.api).list_resource_slice
    wait_until(lambda: not slices().items, 60, "kubelet to delete the nodes' ResourceSlices", API_POLL)
    assert [a.metadata.name for a in core.list_namespaced_service_account(NAMESPACE).items] == ["default"]
    assert not core.list_namespaced_service(NAMESPACE).items
    now = cluster_scoped(cluster.api)
    added = {kind: sorted(now[kind] - names) for kind, names in installed.cluster_before.items()}
    assert added == {kind: [NAMESPACE] if kind == "namespaces" else [] for kind in added}
    guide.run("namespace")
    guide.run("node-metadata")
    guide.run("capacity")
    guide.run("run-dir")
    assert cluster_scoped(cluster.api) == installed.cluster_before
    for node in core.list_node().items:
        labels, annotations = installed.nodes_before[node.metadata.name]
        assert dict(node.metadata.labels) == labels
        assert dict(node.metadata.annotations) == annotations
    for node in cluster.nodes.values():
        assert not node.cri_socket.parent.exists(), f"node {node.name}: {node.cri_socket.parent} is still there"


def test_the_tests_ran_every_step_of_the_guide(installed: Installed) -> None:
    assert sorted(set(installed.guide.ran)) == sorted(guide_steps())
