"""gpushare installed with the wiring by hand of docs/operations.md ("Without NRI, or with the default
scheduler"), on the same kind of cluster as test_helm_install.py: ``nodeAgent.enforcement=cri-shim``,
each kubelet pointed at its node agent's CRI shim, and ``scheduler.enabled=false``, the control plane's
kube-scheduler configured from the chart's ConfigMap. Then an example and a pod asking for no GPU, ``kill
-9`` of a node agent whose shim kubelet talks to (the node stays Ready), and the wiring undone and gpushare
uninstalled, after which the cluster holds what it held before.

Every command is the guide's own (:mod:`support.guide`); this module runs every step of that section.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from gpushare.crishim.detached import escape_dirs
from kubernetes import client
from support.guide import guide_steps
from support.install import (
    API_POLL,
    BASE_VALUES,
    NAMESPACE,
    Installed,
    assert_survives_kill_9,
    cluster_scoped,
    installing,
)
from support.waiting import wait_until

from gpushare.contract.names import DEFAULT_SCHEDULER_NAME, ENV_VISIBLE_DEVICES, RESOURCE_MEM, VISIBLE_DEVICES_VOID
from gpushare.sandbox import image
from gpushare.sandbox.examples import EXAMPLES
from gpushare.sandbox.nodecgroups import remove_cgroup_root
from gpushare.sandbox.shippedcluster import SCHEDULER_CONFIG, shipped_cluster_available

UNAVAILABLE = shipped_cluster_available() or image.missing()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no Helm install here: {UNAVAILABLE}")

MANUAL = "Without NRI, or with the default scheduler: wiring by hand"
VALUES = {
    **BASE_VALUES,
    "nodeAgent": {**BASE_VALUES["nodeAgent"], "enforcement": "cri-shim"},
    "scheduler": {"enabled": False},
}
SHIM_ENDPOINT = "unix:///run/gpushare/cri.sock"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    measurements = tmp_path_factory.mktemp("cri-shim-install") / "measurements.json"
    try:
        with installing(VALUES, measurements) as state:
            yield state
    finally:
        remove_escaped_cgroups()


def remove_escaped_cgroups() -> None:
    """Remove the cgroup the node agents' shims escaped to, at the roots of the machine's hierarchies,
    once the shims, which end a moment after their cluster's containerd, have left it."""
    escaped = [found for found in escape_dirs(Path("/sys/fs/cgroup")) if found.is_dir()]

    def empty() -> bool:
        return not any((found / "cgroup.procs").read_text().strip() for found in escaped if found.is_dir())

    wait_until(empty, 60, "the detached shims to end", 0.2)
    remove_cgroup_root(escaped)


def kubelet_config(installed: Installed, node: str) -> dict[str, object]:
    return dict(yaml.safe_load((installed.cluster.nodes[node].kubelet_dir / "config.yaml").read_text()))


def test_kubelet_talks_to_the_shim_as_the_guide_says(installed: Installed) -> None:
    guide = installed.guide
    guide.run("label")
    guide.run("install")
    guide.run("agent-ready")
    output = guide.run("kubelet-to-shim")
    assert "RuntimeName:  containerd" in output, output
    guide.run("node-ready")
    for node in installed.cluster.nodes:
        config = kubelet_config(installed, node)
        assert config["containerRuntimeEndpoint"] == config["imageServiceEndpoint"] == SHIM_ENDPOINT

    def offers_gpu_mem() -> bool:
        return all(
            int((n.status.allocatable or {}).get(RESOURCE_MEM, "0")) > 0 for n in installed.core.list_node().items
        )

    # the device plugin registered again with the restarted kubelet
    wait_until(offers_gpu_mem, 60, f"every node to offer {RESOURCE_MEM}", API_POLL)


def test_kube_scheduler_reads_the_charts_configuration(installed: Installed) -> None:
    installed.guide.run("scheduler-files")
    config = yaml.safe_load((installed.cluster.workdir / "etc-kubernetes" / SCHEDULER_CONFIG.name).read_text())
    service = installed.core.read_namespaced_service("gpushare-extender", NAMESPACE)
    assert {e["urlPrefix"] for e in config["extenders"]} == {f"https://{service.spec.cluster_ip}:32766"}
    assert {e["tlsConfig"]["serverName"] for e in config["extenders"]} == {f"gpushare-extender.{NAMESPACE}.svc"}
    installed.cluster.restart_scheduler(SCHEDULER_CONFIG)


def test_an_example_runs_on_its_cards_and_a_pod_without_gpus_sees_none(installed: Installed) -> None:
    installed.guide.run("check")
    installed.pods.append("shared-1")
    installed.assert_sees_its_cards("shared-1")
    # no admission policy: the pod keeps the scheduler it names, the patched default one
    assert installed.pod("shared-1")["spec"]["schedulerName"] == DEFAULT_SCHEDULER_NAME
    installed.kubectl_apply(EXAMPLES / "no-gpu-all-devices.yaml")
    pod = installed.wait_running("no-gpu-all-devices")
    node = installed.cluster.nodes[pod["spec"]["nodeName"]]
    assert node.container_env("default", "no-gpu-all-devices", "main")[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID


def test_kill_9_of_a_node_agent_whose_shim_kubelet_talks_to_keeps_the_node_ready(installed: Installed) -> None:
    node = installed.pod("shared-1")["spec"]["nodeName"]
    assert_survives_kill_9(installed, node, "cri_shim_kill_9")


def test_undoing_the_wiring_and_uninstalling_leaves_the_cluster_as_it_was(installed: Installed) -> None:
    guide, core, cluster = installed.guide, installed.core, installed.cluster
    installed.delete_pods()
    cluster.restart_scheduler(None)  # step 1: kube-scheduler back to its own configuration
    guide.run("scheduler-files-removed")
    assert not (cluster.workdir / "etc-kubernetes" / "gpushare").exists()
    guide.run("kubelet-to-containerd")
    for node in cluster.nodes:
        assert kubelet_config(installed, node) == yaml.safe_load(installed.kubelet_configs[node])
    guide.run("uninstall")
    wait_until(lambda: not core.list_namespaced_pod(NAMESPACE).items, 60, f"the pods of {NAMESPACE} to end", API_POLL)
    guide.run("run-dir")
    guide.run("namespace")
    guide.run("node-metadata")
    guide.run("capacity")
    assert cluster_scoped(cluster.api) == installed.cluster_before
    for node in core.list_node().items:
        labels, annotations = installed.nodes_before[node.metadata.name]
        assert dict(node.metadata.labels) == labels
        assert dict(node.metadata.annotations) == annotations
    for each in cluster.nodes.values():
        assert not each.cri_socket.parent.exists(), f"node {each.name}: {each.cri_socket.parent} is still there"
    assert not client.ResourceV1Api(cluster.api).list_resource_slice().items


def test_the_tests_ran_every_step_of_the_wiring_by_hand(installed: Installed) -> None:
    assert set(guide_steps(MANUAL)) <= set(installed.guide.ran)
