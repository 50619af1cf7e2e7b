"""Restarts on a real node: kubelet (it wipes the device-plugin directory) and the gpushare node agent."""

from __future__ import annotations

from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.names import NODE_ANN_KUBELET_WATCHING, RESOURCE_MEM
from gpushare.sandbox.realcluster import RealCluster

from .conftest import API_POLL, POD_TIMEOUT, Pods, assert_sees_assigned_cards, pod_manifest, scheduling_failure


def container_id(pods: Pods, name: str) -> str:
    return pods.get(name)["status"]["containerStatuses"][0]["containerID"]


def test_after_a_kubelet_restart_the_plugin_registers_again_and_new_pods_run(
    cluster: RealCluster, core: client.CoreV1Api, pods: Pods
) -> None:
    before = pods.create(pod_manifest(pods.name("pre-kubelet"), node="node-b"))
    pods.wait_running(before)
    cluster.restart_kubelet("node-b")  # returns once the plugin registered again and kubelet reported it
    after = pods.create(pod_manifest(pods.name("post-kubelet"), node="node-b"))
    pods.wait_running(after)
    assert_sees_assigned_cards(pods, after)
    assert pods.phase(before) == "Running"


def test_after_a_node_agent_restart_running_pods_are_untouched_and_new_pods_run(
    cluster: RealCluster, pods: Pods
) -> None:
    running = pods.create(pod_manifest(pods.name("pre-agent"), ({RESOURCE_MEM: 3}, {RESOURCE_MEM: 2}),
                                       node="node-b"))  # fmt: skip
    pods.wait_running(running)
    env_before = {ctr: pods.env(running, ctr) for ctr in ("main", "c1")}
    id_before = container_id(pods, running)
    cluster.restart_agent("node-b")
    cluster.wait_node_ready(cluster.nodes["node-b"])
    new = pods.create(pod_manifest(pods.name("post-agent"), node="node-b"))
    pods.wait_running(new)
    assert_sees_assigned_cards(pods, new)
    assert pods.phase(running) == "Running"
    assert container_id(pods, running) == id_before
    assert {ctr: pods.env(running, ctr) for ctr in ("main", "c1")} == env_before


def test_a_gpu_pod_created_while_kubelet_is_down_is_held_off_the_node_and_runs_once_kubelet_is_back(
    cluster: RealCluster, core: client.CoreV1Api, pods: Pods
) -> None:
    """Bound while kubelet restarts, a pod could be admitted before the plugin registered and fail for
    good; the node agent says no kubelet is watching, and the extender places nothing there till one is."""

    def watching() -> str | None:
        return (core.read_node("node-b").metadata.annotations or {}).get(NODE_ANN_KUBELET_WATCHING)

    cluster.stop_kubelet("node-b")
    node = cluster.nodes["node-b"]
    try:
        wait_until(lambda: watching() == "false", POD_TIMEOUT, "node-b to say no kubelet is watching", API_POLL)
        name = pods.create(pod_manifest(pods.name("while-down"), node="node-b"))
        message = scheduling_failure(core, name)
        assert "no kubelet is watching its gpushare device plugin" in message, message
        assert not pods.get(name)["spec"].get("nodeName")
    finally:
        cluster.start_kubelet(node)
    pods.wait_running(name)
    assert_sees_assigned_cards(pods, name)
    assert watching() == "true"
    cluster.wait_node_ready(node)
