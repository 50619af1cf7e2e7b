"""GPU memory limits on the real cluster: the node agent has the driver hold each GPU pod's cgroup to its
share of each card it shares (per-cgroup limits, driver 615+), before its GPU containers start.

The limits are read back through NVML itself (``nvmlDeviceGetMemoryLimits_v1``, in a child process with
the node's driver library), on the cgroup the running container's ``/proc/PID/cgroup`` names, so that
the same checks hold on a real node with a 615+ driver. Here the node runs the fake libnvidia-ml
presenting a DGX A100; a second NVML node presents a driver older than 615, and the simulated nodes
have no driver at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support.waiting import wait_until

from gpushare.cards import ENFORCED
from gpushare.contract.names import ANN_REQUIRE_MEMORY_LIMIT, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.request import parse_pod_request
from gpushare.sandbox.nvmllimits import NO_LIMIT, Limits, clear_limits, read_limits
from gpushare.sandbox.realcluster import RealCluster
from gpushare.usage import held_units, pod_allocation

from .conftest import API_POLL, NVML_NODE, OLD_DRIVER_NODE, Pods, pod_manifest


def nvml_env(cluster: RealCluster) -> dict[str, str] | None:
    """The NVML node's driver library: the fake's environment here, the real library's on a real node."""
    node = cluster.nodes[NVML_NODE]
    return node.fake_nvml.env() if node.fake_nvml is not None else None


def pod_cgroup(pods: Pods, name: str, container: str = "main") -> Path:
    return pods.cluster.nodes[NVML_NODE].pod_cgroup("default", name, container)


def limits_of(pods: Pods, name: str) -> Limits:
    return read_limits(pod_cgroup(pods, name), nvml_env(pods.cluster))


def expected(pods: Pods, name: str) -> Limits:
    """Each card's (soft, hard) the pod should have: its share where it shares the card, else none."""
    pod = pods.get(name)
    cards = pods.cluster.node_inventory(NVML_NODE).cards
    held = held_units(pod_allocation(pod, cards) or {}, parse_pod_request(pod))
    unit = pods.cluster.node_inventory(NVML_NODE).unit
    limits: Limits = {c.uuid: NO_LIMIT for c in cards}
    for card in cards:
        if 0 < held.get(card.uuid, 0) < unit.units_of(card.memory_mib):
            share = held[card.uuid] * unit.bytes
            limits[card.uuid] = (share, share)
    return limits


def run_on_nvml_node(pods: Pods, prefix: str, limits: list[dict[str, int]], **kwargs: Any) -> str:
    name = pods.create(pod_manifest(pods.name(prefix), limits, node=NVML_NODE, **kwargs))
    pods.wait_running(name)
    return name


def test_the_inventory_says_on_which_cards_limits_are_enforced(cluster: RealCluster) -> None:
    assert {c.memory_limits for c in cluster.node_inventory(NVML_NODE).cards} == {ENFORCED}
    (old,) = {c.memory_limits for c in cluster.node_inventory(OLD_DRIVER_NODE).cards}
    assert "615" in old
    assert all("simulated" in c.memory_limits for c in cluster.node_inventory("node-a").cards)


def test_a_shared_pod_is_held_to_its_share_on_exactly_its_card(pods: Pods) -> None:
    name = run_on_nvml_node(pods, "limit-one", [{RESOURCE_MEM: 8}])
    seen, want = limits_of(pods, name), expected(pods, name)
    assert seen == want
    assert sorted(v[1] for v in seen.values() if isinstance(v, tuple) and v != NO_LIMIT) == [8 << 30]


def test_a_two_card_pod_gets_one_limit_per_card(pods: Pods) -> None:
    name = run_on_nvml_node(pods, "limit-two", [{RESOURCE_MEM: 16, RESOURCE_COUNT: 2}])
    seen = limits_of(pods, name)
    assert seen == expected(pods, name)
    assert len([v for v in seen.values() if v != NO_LIMIT]) == 2


def test_a_multi_container_pod_gets_the_sum_of_its_containers(pods: Pods) -> None:
    name = run_on_nvml_node(pods, "limit-multi", [{RESOURCE_MEM: 6}, {RESOURCE_MEM: 2}])
    seen = limits_of(pods, name)
    assert seen == expected(pods, name)
    assert sum(v[1] for v in seen.values() if isinstance(v, tuple) and v != NO_LIMIT) == 8 << 30


@pytest.mark.parametrize("limits", [{}, {RESOURCE_COUNT: 1}], ids=["no-gpu", "whole-card"])
def test_a_pod_without_a_gpu_or_with_a_whole_card_gets_no_limit(pods: Pods, limits: dict[str, int]) -> None:
    name = run_on_nvml_node(pods, "limit-none", [limits])
    assert set(limits_of(pods, name).values()) == {NO_LIMIT}


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


def test_a_deleted_pods_soft_limits_are_released_before_its_cgroup_goes(pods: Pods, core: client.CoreV1Api) -> None:
    """The node agent clears the limits once the pod's sandbox is stopped, so the driver never drops a
    soft limit (a guarantee) along with the cgroup; the fake notes any it drops that way."""
    fake = pods.cluster.nodes[NVML_NODE].fake_nvml
    if fake is None:
        pytest.skip("only the fake libnvidia-ml records the soft limits dropped with their cgroup")
    name = run_on_nvml_node(pods, "limit-released", [{RESOURCE_MEM: 4}])
    cgroup = pod_cgroup(pods, name)
    want = expected(pods, name)
    assert limits_of(pods, name) == want and set(want.values()) != {NO_LIMIT}
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    wait_until(lambda: not cgroup.exists(), 60, f"pod {name}'s cgroup to be removed", API_POLL)
    read_limits(cgroup.parent, nvml_env(pods.cluster))  # any NVML call drops what went with the cgroup
    assert [leak for leak in fake.leaks() if Path(leak[2]).name == cgroup.name] == []
    assert not [key for key in fake.limits() if Path(key[1]).name == cgroup.name]


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
