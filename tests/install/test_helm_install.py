"""gpushare installed the way docs/operations.md tells an operator to, on a real Kubernetes v1.37 cluster
as a provider hands it over (:class:`~gpushare.sandbox.shippedcluster.ShippedCluster`: containerd 2
with NRI on, as it comes, and kube-scheduler as it comes): the image in each node's containerd, then
``helm install`` of deploy/helm/gpushare and nothing else. No node's file and no control-plane
manifest is touched: the node agent enforces the cards through containerd's NRI, and the chart runs
its own kube-scheduler, to which a MutatingAdmissionPolicy routes GPU pods.

Then: the example pods on their cards; ``kill -9`` of a node agent (the node stays Ready, the agent comes
back, a GPU pod made meanwhile runs on its card); ``helm upgrade`` to another policy while GPU pods are
placed, and one that rolls the node agent on both nodes, with no drain, while GPU pods are made one a
second; a DRA claim on the card of each node offered through DRA; a namespace opting out of the
chart's scheduler; and ``helm uninstall``, after which the cluster holds what the guide says it holds
and GPU pods keep the scheduler they name.

Every command is the guide's own (:mod:`support.guide`), but ``kubectl apply`` of deploy/examples. The
tests run in file order, each on what the ones before it did, on one cluster: two nodes with simulated
cards behind the fake NVML driver, one a mixed machine and one a DGX A100. The time from ``helm
install`` to the first example running, and what the rolls cost, are printed (``pytest -s``) and kept
in ``measurements.json`` under the session's temporary directory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from support.guide import guide_steps
from support.install import (
    AGENT_CONTAINER,
    AGENT_SELECTOR,
    API_POLL,
    BASE_VALUES,
    NAMESPACE,
    Installed,
    PodStream,
    ReadyWatch,
    assert_kept_their_cards,
    assert_survives_kill_9,
    cluster_scoped,
    gpu_pod,
    installing,
    ready,
    running_state,
)
from support.waiting import wait_until

from gpushare.contract.names import (
    DEFAULT_SCHEDULER_NAME,
    ENV_VISIBLE_DEVICES,
    NAMESPACE_LABEL_SCHEDULER,
    NAMESPACE_SCHEDULER_OPT_OUT,
    RESOURCE_MEM,
    SCHEDULER_NAME,
    VISIBLE_DEVICES_VOID,
)
from gpushare.sandbox import image
from gpushare.sandbox.examples import EXAMPLES
from gpushare.sandbox.realcluster import as_sandbox_pod
from gpushare.sandbox.shippedcluster import shipped_cluster_available

UNAVAILABLE = shipped_cluster_available() or image.missing()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no Helm install here: {UNAVAILABLE}")

#: the guide's section for clusters without NRI or with the default scheduler patched; this module
#: runs every other step of the guide
MANUAL = "Without NRI, or with the default scheduler: wiring by hand"
#: the tests' values: the base ones (the image, the fake driver's path), both admission guards, so
#: that the webhook runs as a Deployment too, and card 1 of each node offered through DRA
#: (docs/operations.md, "Dynamic Resource Allocation"), the others through the device plugin
VALUES = {**BASE_VALUES, "admission": "both", "dra": {"enabled": True, "cards": "1"}}
#: the example pods that run (too-big stays Pending by design)
RUNNING_EXAMPLES = ("multi-container", "shared-1", "shared-2", "two-cards", "a100-only", "nvlink-pair")
#: at most this many GPU pods are made, one a second, while an upgrade rolls the extender; the node
#: agent's roll gets at most ROLLING
DURING_UPGRADE, ROLLING = 12, 150
#: the node whose agent is killed
KILLED = "node-a"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    measurements = tmp_path_factory.mktemp("helm-install") / "measurements.json"
    with installing(VALUES, measurements) as state:
        yield state


def test_helm_install_runs_every_part_as_a_pod_and_an_example_runs(installed: Installed) -> None:
    guide, core, cluster = installed.guide, installed.core, installed.cluster
    scheduler = cluster.scheduler
    guide.run("label")
    began, began_at = time.monotonic(), datetime.now(UTC)
    guide.run("install")
    helm_install = time.monotonic() - began
    guide.run("check")
    installed.pods.append("shared-1")
    # when its container started, as kubelet reports it (to the second)
    (status,) = installed.pod("shared-1")["status"]["containerStatuses"]
    started = datetime.fromisoformat(status["state"]["running"]["startedAt"])
    installed.measured.record(
        "install",
        {
            "helm_install_wait_s": round(helm_install, 1),
            "install_to_first_example_running_s": round((started - began_at).total_seconds(), 1),
        },
    )
    pods = core.list_namespaced_pod(NAMESPACE).items
    agents = {p.spec.node_name: p for p in pods if p.metadata.name.startswith("gpushare-node-agent-")}
    assert set(agents) == set(cluster.nodes)
    for agent in agents.values():
        assert agent.spec.host_network
        paths = {v.host_path.path for v in agent.spec.volumes if v.host_path is not None}
        # the runtime's NRI socket, and kubelet's device plugins
        assert {"/var/lib/kubelet/device-plugins"} <= paths and paths & {"/var/run/nri", "/run/nri"}, paths
    for prefix in ("gpushare-extender-", "gpushare-webhook-"):
        replicas = [p for p in pods if p.metadata.name.startswith(prefix)]
        assert [ready(p) for p in replicas] == [True, True], prefix
    assert any(p.metadata.name.startswith(f"{SCHEDULER_NAME}-") and ready(p) for p in pods), "no gpushare-scheduler"
    # each agent read its node's cards through the driver library the chart mounts: card 1 is DRA's
    assert [c.index for c in installed.inventory("node-a").cards] == [0, 2, 3]
    assert {c.model for c in installed.inventory("node-b").cards} == {"NVIDIA A100-SXM4-80GB"}
    # the admission policy sent the example to the chart's scheduler; the cluster's own is as it was
    assert installed.pod("shared-1")["spec"]["schedulerName"] == SCHEDULER_NAME
    assert cluster.scheduler is scheduler and scheduler is not None and scheduler.check() is None
    installed.assert_sees_its_cards("shared-1")


def test_the_examples_run_with_the_cards_the_scheduler_wrote(installed: Installed) -> None:
    installed.kubectl_apply(*(path for path in sorted(EXAMPLES.glob("*.yaml")) if path.stem != "shared-1"))
    for name in RUNNING_EXAMPLES:
        installed.wait_running(name)
        installed.assert_sees_its_cards(name)
        assert installed.pod(name)["spec"]["schedulerName"] == SCHEDULER_NAME
    installed.wait_running("no-gpu-all-devices")
    pod = installed.pod("no-gpu-all-devices")
    # a pod that asks for no GPU keeps the default scheduler, and the node agent hides every card from it
    assert pod["spec"]["schedulerName"] == DEFAULT_SCHEDULER_NAME
    node = installed.cluster.nodes[pod["spec"]["nodeName"]]
    assert node.container_env("default", "no-gpu-all-devices", "main")[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID


def test_kill_9_of_a_node_agent_keeps_the_node_ready_and_every_pod_on_its_card(installed: Installed) -> None:
    assert_survives_kill_9(installed, KILLED, "kill_9")


def scheduled_at(pod: dict[str, Any]) -> datetime:
    """When the pod was bound (the end of time while it isn't)."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "True":
            return datetime.fromisoformat(condition["lastTransitionTime"])
    return datetime.max.replace(tzinfo=UTC)


def settled(installed: Installed, stream: PodStream, key: str) -> Callable[[], None]:
    """Wait for the stream's pods and record what it cost under ``key``; what checks that none sees a
    card the scheduler didn't write for it, and that none failed (to be called once the test has
    checked the rest)."""
    stream.settle()
    wrong = stream.wrong_cards()
    installed.measured.record(key, stream.summary(wrong))

    def check() -> None:
        assert not wrong, wrong
        assert not stream.failed, stream.failed

    return check


def test_helm_upgrade_rolls_the_extender_with_no_pod_bound_wrongly(installed: Installed) -> None:
    core, apps = installed.core, client.AppsV1Api(installed.cluster.api)
    kept = {name: core.read_namespaced_secret(name, NAMESPACE).data for name in ("gpushare-ca", "gpushare-client-ca")}
    old = {p.metadata.name for p in core.list_namespaced_pod(NAMESPACE).items if "extender" in p.metadata.name}
    with PodStream(installed, "during-upgrade", DURING_UPGRADE) as stream:
        installed.guide.run("upgrade")
        rolled = datetime.now(UTC)
    # scheduling went on while the replicas were replaced
    made = list(stream.made)
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
    check_stream = settled(installed, stream, "extender_roll")
    # pods placed after the upgrade reach the new replicas
    installed.wait_running(installed.create(gpu_pod("after-upgrade", 4)))
    installed.assert_sees_its_cards("after-upgrade")
    check_stream()


def test_helm_upgrade_rolls_the_node_agent_with_no_drain(installed: Installed) -> None:
    core, apps = installed.core, client.AppsV1Api(installed.cluster.api)
    old = {p.metadata.uid for p in core.list_namespaced_pod(NAMESPACE, label_selector=AGENT_SELECTOR).items}
    running = running_state(installed)
    limits = {node: [c.memory_limits for c in installed.inventory(node).cards] for node in installed.cluster.nodes}
    began = time.monotonic()
    with ReadyWatch(core, list(installed.cluster.nodes)) as watch, PodStream(installed, "rolling", ROLLING) as stream:
        installed.guide.run("upgrade-node-agent")
    roll = time.monotonic() - began
    check_stream = settled(installed, stream, "node_agent_roll")
    installed.measured.record("node_agent_roll_s", round(roll, 1))
    installed.measured.record("memory_limits", {node: sorted(set(kinds)) for node, kinds in limits.items()})
    assert len(stream.made) >= 2, "no GPU pod was made while the node agent rolled"
    assert not watch.not_ready, watch.not_ready
    agents = core.list_namespaced_pod(NAMESPACE, label_selector=AGENT_SELECTOR).items
    assert len(agents) == len(installed.cluster.nodes) and not {p.metadata.uid for p in agents} & old
    for agent in agents:
        (container,) = [c for c in agent.spec.containers if c.name == AGENT_CONTAINER]
        assert container.resources.limits["memory"] == "768Mi"
    # the guide's `rollout status` waited for the last node
    daemonset = apps.read_namespaced_daemon_set("gpushare-node-agent", NAMESPACE).status
    assert daemonset.updated_number_scheduled == daemonset.number_ready == len(installed.cluster.nodes)
    # the pods that ran before the roll run on in the same containers, on the same cards, and each
    # card's memory limits are enforced as before
    assert_kept_their_cards(installed, running)
    assert {node: [c.memory_limits for c in installed.inventory(node).cards] for node in limits} == limits
    check_stream()


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

        def offered(node: str = node, units: int = units) -> bool:
            return int((core.read_node(node).status.allocatable or {}).get(RESOURCE_MEM, "0")) == units

        # kubelet reports the device plugin's devices with the node's status, every 10 s
        wait_until(offered, 30, f"node {node} to offer {units} {RESOURCE_MEM}", API_POLL)

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


def scheduler_of_a_new_gpu_pod(installed: Installed) -> str:
    """The scheduler admission gives a GPU pod that names none (a dry run: nothing is created)."""
    created = installed.core.create_namespaced_pod("default", as_sandbox_pod(gpu_pod("routed", 4)), dry_run="All")
    return str(created.spec.scheduler_name)


def test_a_namespace_labelled_so_keeps_the_scheduler_its_gpu_pods_name(installed: Installed) -> None:
    core = installed.core
    assert scheduler_of_a_new_gpu_pod(installed) == SCHEDULER_NAME
    label = {"metadata": {"labels": {NAMESPACE_LABEL_SCHEDULER: NAMESPACE_SCHEDULER_OPT_OUT}}}
    core.patch_namespace("default", label)
    try:
        # kube-apiserver reads namespaces' labels from its cache
        wait_until(
            lambda: scheduler_of_a_new_gpu_pod(installed) == DEFAULT_SCHEDULER_NAME,
            10,
            "the policy to leave the namespace's GPU pods alone",
            API_POLL,
        )
    finally:
        core.patch_namespace("default", {"metadata": {"labels": {NAMESPACE_LABEL_SCHEDULER: None}}})
    wait_until(lambda: scheduler_of_a_new_gpu_pod(installed) == SCHEDULER_NAME, 10, "the policy again", API_POLL)


def test_helm_uninstall_leaves_what_the_guide_says(installed: Installed) -> None:
    guide, core, cluster = installed.guide, installed.core, installed.cluster
    installed.delete_pods()
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
    # GPU pods keep the scheduler they name once the chart's is gone
    assert scheduler_of_a_new_gpu_pod(installed) == DEFAULT_SCHEDULER_NAME
    now = cluster_scoped(cluster.api)
    added = {kind: sorted(now[kind] - names) for kind, names in installed.cluster_before.items()}
    assert added == {kind: [NAMESPACE] if kind == "namespaces" else [] for kind in added}
    guide.run("namespace")
    guide.run("node-metadata")
    guide.run("capacity")
    assert cluster_scoped(cluster.api) == installed.cluster_before
    for node in core.list_node().items:
        labels, annotations = installed.nodes_before[node.metadata.name]
        assert dict(node.metadata.labels) == labels
        assert dict(node.metadata.annotations) == annotations
    for node in cluster.nodes.values():
        assert (node.kubelet_dir / "config.yaml").read_text() == installed.kubelet_configs[node.name]
        assert not node.cri_socket.parent.exists(), f"node {node.name}: {node.cri_socket.parent} is there"


def test_the_tests_ran_every_step_of_the_guide_but_the_manual_wiring(installed: Installed) -> None:
    assert sorted(set(installed.guide.ran)) == sorted(set(guide_steps()) - set(guide_steps(MANUAL)))
