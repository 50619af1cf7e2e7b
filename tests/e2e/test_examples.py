"""The pods of deploy/examples on the real cluster, as a user applies them."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.stream import stream
from support.waiting import wait_until

from gpushare.contract.names import ENV_MEM_PREFIX, ENV_VISIBLE_DEVICES, RESOURCE_MEM, VISIBLE_DEVICES_VOID
from gpushare.inspection.views import node_address
from gpushare.sandbox.examples import load_examples
from gpushare.sandbox.realcluster import RealCluster, as_sandbox_pod

from .conftest import API_POLL, NODES, Pods, assert_sees_assigned_cards

RUNNING = ("multi-container", "shared-1", "shared-2", "two-cards", "a100-only", "nvlink-pair", "no-gpu-all-devices")


@pytest.fixture(scope="module")
def examples(cluster: RealCluster, core: client.CoreV1Api) -> Iterator[Pods]:
    made = Pods(cluster, core)
    for manifest in load_examples():
        made.create(as_sandbox_pod(manifest))
    try:
        yield made
    finally:
        made.delete_all()


@pytest.mark.parametrize("name", [n for n in RUNNING if n != "no-gpu-all-devices"])
def test_example_runs_with_the_cards_the_scheduler_wrote(examples: Pods, name: str) -> None:
    examples.wait_running(name)
    assert_sees_assigned_cards(examples, name)


def test_two_card_example_sees_two_distinct_cards(examples: Pods) -> None:
    examples.wait_running("two-cards")
    (slices,) = examples.allocation("two-cards").values()
    uuids = examples.env("two-cards")[ENV_VISIBLE_DEVICES].split(",")
    assert len(set(uuids)) == 2 and set(uuids) == {s.uuid for s in slices}


def test_the_card_rule_examples_get_the_cards_they_ask_for(examples: Pods) -> None:
    examples.wait_running("a100-only")
    ((card,),) = examples.allocation("a100-only").values()
    node = examples.get("a100-only")["spec"]["nodeName"]
    cards = {c.uuid: c for c in examples.cluster.node_inventory(node).cards}
    assert cards[card.uuid].model.startswith("A100-")
    examples.wait_running("nvlink-pair")
    ((first, second),) = examples.allocation("nvlink-pair").values()
    node = examples.get("nvlink-pair")["spec"]["nodeName"]
    cards = {c.uuid: c for c in examples.cluster.node_inventory(node).cards}
    assert second.uuid in cards[first.uuid].nvlink_peers


def test_too_big_stays_pending_and_says_why(examples: Pods, core: client.CoreV1Api) -> None:
    def unschedulable() -> str | None:
        for cond in (examples.get("too-big").get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                return cond.get("message", "")
        return None

    message = wait_until(unschedulable, 30, "too-big to be marked Unschedulable", API_POLL)
    assert f"0/{len(NODES)} nodes are available" in message and RESOURCE_MEM in message, message
    events = core.list_namespaced_event(
        "default", field_selector="involvedObject.name=too-big,reason=FailedScheduling"
    ).items
    assert events and RESOURCE_MEM in events[0].message
    assert examples.phase("too-big") == "Pending"
    assert not (examples.get("too-big")["spec"].get("nodeName"))


def test_the_pod_without_a_gpu_request_sees_void(examples: Pods) -> None:
    examples.wait_running("no-gpu-all-devices")
    env = examples.env("no-gpu-all-devices")
    assert env[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID
    assert not [k for k in env if k.startswith(ENV_MEM_PREFIX)]


def test_a_running_examples_log_and_a_command_in_it_come_through_its_nodes_kubelet(
    examples: Pods, core: client.CoreV1Api
) -> None:
    """``kubectl logs`` and ``kubectl exec``: kube-apiserver reaches the kubelet at the address its node
    reports, which is not loopback (kubelet refuses that) and is what ``gpushare inspect`` shows."""
    pod = examples.wait_running("shared-1")
    node = core.read_node(pod["spec"]["nodeName"]).to_dict()
    address = node_address(node)
    assert address != "unknown" and not ipaddress.ip_address(address).is_loopback, node["status"]["addresses"]
    visible = f"{ENV_VISIBLE_DEVICES}={examples.env('shared-1')[ENV_VISIBLE_DEVICES]}"

    def logged() -> str | None:
        text = core.read_namespaced_pod_log("shared-1", "default", container="main")
        return text if visible in text else None

    wait_until(logged, 30, "shared-1's log to show its env", API_POLL)
    command = ["sh", "-c", f"echo ${ENV_VISIBLE_DEVICES}"]
    answer = stream(core.connect_get_namespaced_pod_exec, "shared-1", "default", container="main", command=command,
                    stderr=True, stdin=False, stdout=True, tty=False)  # fmt: skip
    assert f"{ENV_VISIBLE_DEVICES}={answer.strip()}" == visible
