"""Card models and NVLink as requirements on the real cluster: node-a holds two NVLinked A100-80GB
(NUMA 0) and a T4 (NUMA 1), node-b an A100-40GB and two A10s."""

from __future__ import annotations

from gpushare.extender.verbs import REFUSAL_EVENT
from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.names import ANN_GPU_MODEL, ANN_REQUIRE_NVLINK, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.sandbox.realcluster import RealCluster

from .conftest import API_POLL, POD_TIMEOUT, Pods, assert_sees_assigned_cards, pod_manifest, scheduling_failure


def models_of(cluster: RealCluster, node: str) -> dict[str, str]:
    return {card.uuid: card.model for card in cluster.node_inventory(node).cards}


def test_an_a100_only_pod_lands_on_an_a100_and_one_that_cant_fit_says_why(pods: Pods, core: client.CoreV1Api) -> None:
    a100 = {ANN_GPU_MODEL: "A100-80GB"}
    # 14 GiB fits the T4 too (and is the tightest fit there); the rule keeps it on an A100
    name = pods.create(pod_manifest(pods.name("a100"), ({RESOURCE_MEM: 14},), node="node-a", annotations=a100))
    pods.wait_running(name)
    assert_sees_assigned_cards(pods, name)
    ((card,),) = pods.allocation(name).values()
    assert models_of(pods.cluster, "node-a")[card.uuid] == "A100-80GB"
    big = pods.create(pod_manifest(pods.name("a100-big"), ({RESOURCE_MEM: 90},), annotations=a100))
    message = scheduling_failure(core, big)
    assert "no A100-80GB card has 90 GiB free" in message and "T4 cards ignored" in message, message
    assert pods.phase(big) == "Pending" and not pods.get(big)["spec"].get("nodeName")


def test_an_nvlink_pair_waits_for_free_peers_then_lands_on_them(pods: Pods, core: client.CoreV1Api) -> None:
    # one A100 of node-a taken whole: its free cards are an A100 and the T4, which are not peers
    whole = pods.create(
        pod_manifest(pods.name("whole"), ({RESOURCE_COUNT: 1},), node="node-a", annotations={ANN_GPU_MODEL: "A100"})
    )
    pods.wait_running(whole)
    pair_manifest = pod_manifest(
        pods.name("pair"), ({RESOURCE_MEM: 8, RESOURCE_COUNT: 2},), node="node-a",
        annotations={ANN_REQUIRE_NVLINK: "true"},
    )  # fmt: skip
    pair = pods.create(pair_manifest)
    message = scheduling_failure(core, pair)
    assert "no cards pairwise NVLink-connected (required) can take 2 cards with 4 GiB free each" in message, message
    assert pods.phase(pair) == "Pending"
    core.delete_namespaced_pod(whole, "default", grace_period_seconds=0)
    pods.wait_running(pair, POD_TIMEOUT * 2)  # kube-scheduler retries the pod once the card is freed
    assert_sees_assigned_cards(pods, pair)
    ((first, second),) = pods.allocation(pair).values()
    cards = {card.uuid: card for card in pods.cluster.node_inventory("node-a").cards}
    assert second.uuid in cards[first.uuid].nvlink_peers


def test_a_malformed_request_is_refused_with_its_reason_where_the_user_looks(
    pods: Pods, core: client.CoreV1Api
) -> None:
    """kubectl describe shows the pod's PodScheduled condition and its Events: both name the fault, on the
    real kube-scheduler (not `0/3 nodes are available: .`)."""
    bad = pods.create(
        pod_manifest(pods.name("maybe"), ({RESOURCE_MEM: 8},), node="node-a", annotations={ANN_REQUIRE_NVLINK: "maybe"})
    )
    message = scheduling_failure(core, bad)
    assert f"pod default/{bad}" in message and ANN_REQUIRE_NVLINK in message, message
    assert pods.phase(bad) == "Pending"
    condition = next(c for c in pods.get(bad)["status"]["conditions"] if c["type"] == "PodScheduled")
    assert ANN_REQUIRE_NVLINK in condition["message"], condition

    def refusal() -> str | None:
        events = core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name={bad},reason={REFUSAL_EVENT}"
        ).items
        return events[-1].message if events else None

    assert ANN_REQUIRE_NVLINK in wait_until(refusal, POD_TIMEOUT, f"the extender's {REFUSAL_EVENT} event", API_POLL)
