"""GPU memory limits on the real cluster: the node agent has the driver hold each GPU pod's cgroup to its
share of each card it shares (per-cgroup limits, driver 615+), with the pod's share of what the card can
guarantee as its soft limit, and each GPU container's own cgroup to the container's share with no soft
limit, before its process starts.

The limits are read back through NVML itself (``nvmlDeviceGetMemoryLimits_v1``, in a child process with
the node's driver library), on the cgroups the running container's ``/proc/PID/cgroup`` names, and the
memory a container's process is told it has through ``nvmlDeviceGetMemoryInfo_v2`` from a process moved
into the container's cgroup, so that the same checks hold on a real node with a 615+ driver. Here the node
runs the fake libnvidia-ml presenting a DGX A100; a second NVML node presents a driver older than 615, and
the simulated nodes have no driver at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client
from support.waiting import wait_until

from gpushare.cards import ENFORCED, Card
from gpushare.contract.names import (
    ANN_POLICY,
    ANN_REQUIRE_MEMORY_LIMIT,
    CRI_LABEL_POD_NAME,
    CRI_LABEL_POD_NAMESPACE,
    ENV_MEM_CONTAINER,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.request import parse_pod_request
from gpushare.holdings.pod import held_units, pod_allocation
from gpushare.memlimits.cgroups import detect_layout, pod_cgroups
from gpushare.memlimits.policy import guaranteed_bytes
from gpushare.pb import cri_pb2, cri_pb2_grpc
from gpushare.sandbox.fakenvml import ENV_MACHINE, FakeNvml
from gpushare.sandbox.nvmllimits import NO_LIMIT, Limits, clear_limits, memory_info, read_limits
from gpushare.sandbox.realcluster import RealCluster

from .conftest import API_POLL, NVML_NODE, OLD_DRIVER_NODE, POD_TIMEOUT, Pods, pod_manifest

#: pods packed onto as few cards as will take them
PACKED = {ANN_POLICY: "binpack"}


def nvml_env(cluster: RealCluster) -> dict[str, str] | None:
    """The NVML node's driver library: the fake's environment here, the real library's on a real node."""
    node = cluster.nodes[NVML_NODE]
    return node.fake_nvml.env() if node.fake_nvml is not None else None


def the_fake(cluster: RealCluster) -> FakeNvml:
    """The NVML node's fake library, for what only it records; skips the test on a real driver."""
    fake = cluster.nodes[NVML_NODE].fake_nvml
    if fake is None:
        pytest.skip("only the fake libnvidia-ml records the limits and reservations of removed cgroups")
    return fake


def pod_cgroup(pods: Pods, name: str, container: str = "main") -> Path:
    return pods.cluster.nodes[NVML_NODE].pod_cgroup("default", name, container)


def container_cgroup(pods: Pods, name: str, container: str = "main") -> Path:
    return pods.cluster.nodes[NVML_NODE].container_cgroup("default", name, container)


def limits_of(pods: Pods, name: str) -> Limits:
    return read_limits(pod_cgroup(pods, name), nvml_env(pods.cluster))


def inventory_cards(pods: Pods) -> dict[str, Card]:
    return {card.uuid: card for card in pods.cluster.node_inventory(NVML_NODE).cards}


def limits_for(pods: Pods, held: Mapping[str, int], soft: Callable[[int, Card], int]) -> Limits:
    """Each card's (soft, hard) for a cgroup holding ``held`` units per card UUID: where it shares the
    card, a hard limit of its share and the soft limit ``soft(share, card)``; elsewhere none."""
    inventory = pods.cluster.node_inventory(NVML_NODE)
    limits: Limits = {c.uuid: NO_LIMIT for c in inventory.cards}
    for card in inventory.cards:
        if 0 < held.get(card.uuid, 0) < inventory.units_of(card):
            share = held[card.uuid] * inventory.unit.bytes
            limits[card.uuid] = (soft(share, card), share)
    return limits


def expected(pods: Pods, name: str) -> Limits:
    """The pod cgroup's limits: its share, and that share of what the card can guarantee (the card less
    what its driver reserves) as its soft limit."""
    pod = pods.get(name)
    cards = pods.cluster.node_inventory(NVML_NODE).cards
    return limits_for(pods, held_units(pod_allocation(pod, cards) or {}, parse_pod_request(pod)), guaranteed_bytes)


def expected_of_container(pods: Pods, name: str, container: str = "main") -> Limits:
    """The container cgroup's limits: the container's own share, no soft limit."""
    held = {part.uuid: part.units for part in pods.allocation(name)[container]}
    return limits_for(pods, held, lambda share, card: 0)


def shared(limits: Limits) -> dict[str, tuple[int, int]]:
    """The cards on which ``limits`` has a limit."""
    return {uuid: answer for uuid, answer in limits.items() if isinstance(answer, tuple) and answer != NO_LIMIT}


def run_on_nvml_node(pods: Pods, prefix: str, limits: list[dict[str, int]], **kwargs: Any) -> str:
    name = pods.create(pod_manifest(pods.name(prefix), limits, node=NVML_NODE, **kwargs))
    pods.wait_running(name)
    return name


def run_on_two_containers_on_one_card(pods: Pods, prefix: str) -> str:
    """A pod whose two containers, of 6 and 2 GiB, share one card of the NVML node."""
    name = run_on_nvml_node(pods, prefix, [{RESOURCE_MEM: 6}, {RESOURCE_MEM: 2}], annotations=PACKED)
    used = {part.uuid for parts in pods.allocation(name).values() for part in parts}
    assert len(used) == 1, f"binpack put pod {name}'s containers on cards {used}"
    return name


def kubepods(cluster: RealCluster) -> Path:
    """Kubelet's pod hierarchy root on the NVML node, in the cgroup v2 hierarchy."""
    unified = detect_layout(Path("/proc/self/mountinfo").read_text()).unified
    assert unified is not None, "no cgroup2 mount on this machine"
    return unified / cluster.nodes[NVML_NODE].cgroup_root.strip("/") / "kubepods"


def wait_node_without_pods(cluster: RealCluster) -> None:
    """Wait until kubelet has removed every pod cgroup of the NVML node: the earlier tests' pods are gone,
    with their limits and the reservations their soft limits made."""
    root = kubepods(cluster)
    wait_until(lambda: not pod_cgroups([root]), POD_TIMEOUT, f"the pod cgroups under {root} to go", API_POLL)


def held_by_ancestors(held: Mapping[tuple[str, str], int], cgroup: Path) -> dict[tuple[str, str], int]:
    """Of ``held`` (:meth:`FakeNvml.held`), what ``cgroup``'s ancestors hold, per (card UUID, ancestor)."""
    ancestors = {str(parent) for parent in cgroup.parents}
    return {key: amount for key, amount in held.items() if key[1] in ancestors}


def test_the_inventory_says_on_which_cards_limits_are_enforced(cluster: RealCluster) -> None:
    assert {c.memory_limits for c in cluster.node_inventory(NVML_NODE).cards} == {ENFORCED}
    (old,) = {c.memory_limits for c in cluster.node_inventory(OLD_DRIVER_NODE).cards}
    assert "615" in old
    assert all("simulated" in c.memory_limits for c in cluster.node_inventory("node-a").cards)


def test_a_shared_pod_is_held_to_its_share_on_exactly_its_card(pods: Pods) -> None:
    name = run_on_nvml_node(pods, "limit-one", [{RESOURCE_MEM: 8}])
    seen, want = limits_of(pods, name), expected(pods, name)
    assert seen == want
    ((soft, hard),) = shared(seen).values()
    assert hard == 8 << 30 and soft < hard  # a share of what the card can guarantee, less than the share


def test_a_two_card_pod_gets_one_limit_per_card(pods: Pods) -> None:
    name = run_on_nvml_node(pods, "limit-two", [{RESOURCE_MEM: 16, RESOURCE_COUNT: 2}])
    seen = limits_of(pods, name)
    assert seen == expected(pods, name)
    assert len(shared(seen)) == 2


def test_a_multi_container_pod_gets_the_sum_of_its_containers(pods: Pods) -> None:
    name = run_on_nvml_node(pods, "limit-multi", [{RESOURCE_MEM: 6}, {RESOURCE_MEM: 2}])
    seen = limits_of(pods, name)
    assert seen == expected(pods, name)
    assert sum(hard for _, hard in shared(seen).values()) == 8 << 30


@pytest.mark.parametrize("limits", [{}, {RESOURCE_COUNT: 1}], ids=["no-gpu", "whole-card"])
def test_a_pod_without_a_gpu_or_with_a_whole_card_gets_no_limit(pods: Pods, limits: dict[str, int]) -> None:
    name = run_on_nvml_node(pods, "limit-none", [limits])
    assert set(limits_of(pods, name).values()) == {NO_LIMIT}
    assert set(read_limits(container_cgroup(pods, name), nvml_env(pods.cluster)).values()) == {NO_LIMIT}


def test_a_gpu_containers_own_cgroup_is_held_to_its_share_with_no_soft_limit(pods: Pods) -> None:
    """The runtime removes a container's cgroup without a word to gpushare, so a soft limit there could
    never be given back before it goes: the container gets a hard limit only."""
    name = run_on_nvml_node(pods, "limit-container", [{RESOURCE_MEM: 8}])
    seen = read_limits(container_cgroup(pods, name), nvml_env(pods.cluster))
    assert seen == expected_of_container(pods, name)
    assert list(shared(seen).values()) == [(0, 8 << 30)]


def test_each_container_sees_its_own_share_as_its_cards_memory(pods: Pods) -> None:
    """What ``nvmlDeviceGetMemoryInfo_v2`` (and CUDA's cuMemGetInfo) tells a process in the container is
    its own share, as ``ALIYUN_COM_GPU_MEM_CONTAINER`` says, not its pod's: with the containers packed
    on one card, the pod's share there is their sum."""
    name = run_on_two_containers_on_one_card(pods, "limit-seen")
    unit = pods.cluster.node_inventory(NVML_NODE).unit
    for container, slices in pods.allocation(name).items():
        share = int(pods.env(name, container)[ENV_MEM_CONTAINER]) * unit.bytes
        seen = memory_info(container_cgroup(pods, name, container), nvml_env(pods.cluster))
        assert {part.uuid: seen[part.uuid] for part in slices} == {part.uuid: (share, share) for part in slices}


def test_a_card_filled_by_pods_guarantees_no_more_than_it_has(pods: Pods) -> None:
    """Two pods of 40 GiB packed on one A100 80GB card: their hard limits add up to the card, their soft
    limits (guarantees, which the driver reserves on every ancestor cgroup) to no more than the card less
    what its driver keeps for itself, so every guarantee can be kept."""
    wait_node_without_pods(pods.cluster)
    names = [run_on_nvml_node(pods, "limit-fill", [{RESOURCE_MEM: 40}], annotations=PACKED) for _ in range(2)]
    used = {part.uuid for name in names for parts in pods.allocation(name).values() for part in parts}
    assert len(used) == 1, f"binpack put the pods on cards {used} of an empty node"
    card = inventory_cards(pods)[used.pop()]
    uuid = card.uuid
    guaranteed = (card.memory_mib - card.reserved_mib) << 20
    seen = {name: limits_of(pods, name) for name in names}
    assert seen == {name: expected(pods, name) for name in names}
    assert sum(limits[uuid][1] for limits in seen.values()) == card.memory_mib << 20
    assert sum(limits[uuid][0] for limits in seen.values()) <= guaranteed
    (parent,) = {pod_cgroup(pods, name).parent for name in names}
    reserved = read_limits(parent, nvml_env(pods.cluster))[uuid]  # softLimit: what it holds for the pods
    assert isinstance(reserved, tuple) and 0 < reserved[0] <= guaranteed, reserved


def test_a_process_in_the_container_is_held_by_the_containers_own_limit_under_the_misc_backend(
    pods: Pods, tmp_path: Path
) -> None:
    """On kernels before 6.14 the driver enforces limits through its own ``misc`` backend, which NVIDIA
    does not document as hierarchical: the pod cgroup's limit may not hold the processes of its
    containers, the container cgroup's own does. The same node read through that backend (the
    driver chooses it when it loads) shows each container's process its share, not the whole card."""
    fake = the_fake(pods.cluster)
    misc = tmp_path / f"{fake.machine.stem}-misc.txt"
    misc.write_text("memory-limits-backend misc\n" + fake.machine.read_text())
    name = run_on_two_containers_on_one_card(pods, "limit-misc")
    unit = pods.cluster.node_inventory(NVML_NODE).unit
    for container, slices in pods.allocation(name).items():
        seen = memory_info(container_cgroup(pods, name, container), fake.env() | {ENV_MACHINE: str(misc)})
        want = {part.uuid: (part.units * unit.bytes, part.units * unit.bytes) for part in slices}
        assert {part.uuid: seen[part.uuid] for part in slices} == want, f"container {container}"


def test_a_restarted_node_agent_sets_the_running_pods_limits_again(cluster: RealCluster, pods: Pods) -> None:
    name = run_on_nvml_node(pods, "limit-restart", [{RESOURCE_MEM: 4}])
    want = expected(pods, name)
    clear_limits(pod_cgroup(pods, name), nvml_env(cluster))  # as if they were lost while the agent was away
    assert set(limits_of(pods, name).values()) == {NO_LIMIT}
    cluster.restart_agent(NVML_NODE)
    wait_until(lambda: limits_of(pods, name) == want, 60, f"pod {name}'s limits to be set again", API_POLL)


def test_a_pods_limits_go_with_its_cgroup(pods: Pods, core: client.CoreV1Api) -> None:
    name = run_on_nvml_node(pods, "limit-gone", [{RESOURCE_MEM: 4}])
    cgroup = pod_cgroup(pods, name)
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    wait_until(lambda: not cgroup.exists(), 60, f"pod {name}'s cgroup to be removed", API_POLL)
    answers = read_limits(cgroup, nvml_env(pods.cluster))
    assert all(answer == NO_LIMIT or "Not Found" in str(answer) for answer in answers.values()), answers


def test_a_deleted_pods_limits_are_cleared_before_its_cgroups_go_and_its_reservation_is_given_back(
    pods: Pods, core: client.CoreV1Api
) -> None:
    """The node agent clears the pod's limits, and its containers' still there, once the pod's sandbox is
    stopped, so the driver never drops a soft limit (a guarantee) along with a cgroup, which would leave
    the reservation it made on the cgroup's ancestors held for good; the fake notes any it drops that way."""
    fake = the_fake(pods.cluster)
    wait_node_without_pods(pods.cluster)
    held_before = fake.held()
    name = run_on_nvml_node(pods, "limit-released", [{RESOURCE_MEM: 4}])
    container = container_cgroup(pods, name)
    cgroup = container.parent
    want = expected(pods, name)
    assert limits_of(pods, name) == want and shared(want)
    assert read_limits(container, nvml_env(pods.cluster)) == expected_of_container(pods, name)
    ((uuid, (soft, _)),) = shared(want).items()
    before, during = held_by_ancestors(held_before, cgroup), held_by_ancestors(fake.held(), cgroup)
    reserved = {key: held - before.get(key, 0) for key, held in during.items() if key[0] == uuid}
    assert reserved and set(reserved.values()) == {soft}, reserved  # the pod's guarantee, on every ancestor
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    wait_until(lambda: not cgroup.exists(), 60, f"pod {name}'s cgroup to be removed", API_POLL)
    read_limits(cgroup.parent, nvml_env(pods.cluster))  # any NVML call drops what went with the cgroup
    gone = {container.name, cgroup.name}
    assert [leak for leak in fake.leaks() if Path(leak[2]).name in gone] == []
    assert not [key for key in fake.limits() if Path(key[1]).name in gone]
    assert held_by_ancestors(fake.held(), cgroup) == before


def remove_sandbox_behind_the_agents_back(cluster: RealCluster, pod: str) -> None:
    """Stop and remove the pod's sandbox, its containers with it, straight through the NVML node's
    containerd, as if the node agent's CRI shim had not been there to see it."""
    containerd = cluster.nodes[NVML_NODE].containerd
    assert containerd is not None
    selector = {CRI_LABEL_POD_NAME: pod, CRI_LABEL_POD_NAMESPACE: "default"}
    with grpc.insecure_channel(containerd.address) as channel:
        stub = cri_pb2_grpc.RuntimeServiceStub(channel)
        listing = cri_pb2.ListPodSandboxRequest(filter=cri_pb2.PodSandboxFilter(label_selector=selector))
        sandboxes = stub.ListPodSandbox(listing, timeout=10).items
        assert sandboxes, f"pod {pod} has no sandbox on node {NVML_NODE}"
        for sandbox in sandboxes:
            stub.StopPodSandbox(cri_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=30)
            stub.RemovePodSandbox(cri_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=30)


def test_a_pod_that_ended_while_the_node_agent_was_away_has_its_limits_cleared_when_it_comes_back(
    cluster: RealCluster, pods: Pods, core: client.CoreV1Api
) -> None:
    """The pod's sandbox goes while the agent is down, so nothing clears its limits then; kubelet is
    stopped meanwhile so that the pod's cgroup, whose removal is kubelet's, is still there when the agent
    comes back and sweeps the pod cgroups whose pod has no ready sandbox. A pod still running keeps its."""
    fake = the_fake(cluster)
    node = cluster.nodes[NVML_NODE]
    running = run_on_nvml_node(pods, "limit-kept", [{RESOURCE_MEM: 4}])
    ended = run_on_nvml_node(pods, "limit-ended", [{RESOURCE_MEM: 4}])
    kept, cgroup = limits_of(pods, running), pod_cgroup(pods, ended)
    assert kept == expected(pods, running) and limits_of(pods, ended) == expected(pods, ended)
    cluster.stop_kubelet(NVML_NODE)
    try:
        assert node.agent is not None
        cluster.launcher.stop(node.agent)
        try:
            remove_sandbox_behind_the_agents_back(cluster, ended)
            left = read_limits(cgroup, nvml_env(cluster))
            assert cgroup.is_dir() and shared(left), f"nothing left behind on {cgroup} to sweep: {left}"
        finally:
            cluster.node_runner.start_agent(node)
        wait_until(
            lambda: set(read_limits(cgroup, nvml_env(cluster)).values()) == {NO_LIMIT},
            POD_TIMEOUT, f"the agent to clear the limits pod {ended} left on {cgroup}", API_POLL,
        )  # fmt: skip
        assert cgroup.is_dir(), "the limits went with the cgroup, not by the agent's sweep"
        assert limits_of(pods, running) == kept
        core.delete_namespaced_pod(ended, "default", grace_period_seconds=0)
    finally:
        cluster.start_kubelet(node)
    cluster.wait_node_ready(node, reported_after=time.time() + 1)  # heartbeats are stamped to the second
    wait_until(lambda: not cgroup.exists(), POD_TIMEOUT, f"kubelet to remove pod {ended}'s cgroup", API_POLL)
    read_limits(cgroup.parent, nvml_env(cluster))  # any NVML call drops what went with the cgroup
    assert [leak for leak in fake.leaks() if Path(leak[2]).name == cgroup.name] == []


def test_a_pod_that_requires_limits_is_kept_off_the_old_driver_node_naming_card_and_cause(pods: Pods) -> None:
    name = pods.create(
        pod_manifest(
            pods.name("limit-required"),
            [{RESOURCE_MEM: 4}],
            node=OLD_DRIVER_NODE,
            annotations={ANN_REQUIRE_MEMORY_LIMIT: "true"},
        )
    )

    def refused() -> str | None:
        for cond in (pods.get(name).get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                return str(cond.get("message", ""))
        return None

    message = wait_until(refused, 30, f"pod {name} to be marked Unschedulable", API_POLL)
    assert "no limit-enforcing card on the node" in message and "don't enforce GPU memory limits" in message
    for card in pods.cluster.node_inventory(OLD_DRIVER_NODE).cards:
        assert f"{card.index} ({card.uuid})" in message, message
    assert "needs release 615 or later" in message, message
    assert not pods.get(name)["spec"].get("nodeName")


def test_a_pod_that_requires_limits_runs_where_they_are_enforced(pods: Pods) -> None:
    name = run_on_nvml_node(pods, "limit-ok", [{RESOURCE_MEM: 4}], annotations={ANN_REQUIRE_MEMORY_LIMIT: "true"})
    assert limits_of(pods, name) == expected(pods, name)
