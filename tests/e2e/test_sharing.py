"""Card sharing on the real cluster: equal requests, multi-card sharing pods, concurrent extenders and
pods written by the original Alibaba extender."""

from __future__ import annotations

from collections import defaultdict

from support.waiting import wait_until

from gpushare.contract.aliyun import format_assume_time
from gpushare.contract.names import (
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_DEV,
    ANN_MEM_IDX,
    ANN_MEM_POD,
    ANN_POLICY,
    ENV_MEM_CONTAINER,
    ENV_MEM_IDX,
    ENV_VISIBLE_DEVICES,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.holdings.pod import holds_resources

from .conftest import API_POLL, SECOND_SCHEDULER, Pods, assert_sees_assigned_cards, pod_manifest


def test_two_equal_requests_each_see_their_own_card(pods: Pods) -> None:
    # spread puts them on different cards of one node, so a swap would show in the env
    names = [
        pods.create(pod_manifest(pods.name("equal"), ({RESOURCE_MEM: 20},), node="node-b",
                                 annotations={ANN_POLICY: "spread"}))
        for _ in range(2)
    ]  # fmt: skip
    for name in names:
        pods.wait_running(name)
        assert_sees_assigned_cards(pods, name)
    cards = [pods.env(name)[ENV_VISIBLE_DEVICES] for name in names]
    assert cards[0] != cards[1], "spread should have used two cards"


def test_four_two_card_sharing_pods_run_on_a_three_card_node(pods: Pods) -> None:
    names = [
        pods.create(pod_manifest(pods.name("pair"), ({RESOURCE_MEM: 8, RESOURCE_COUNT: 2},), node="node-a"))
        for _ in range(4)
    ]
    for name in names:
        pods.wait_running(name)
        assert_sees_assigned_cards(pods, name)
        (slices,) = pods.allocation(name).values()
        assert len({s.uuid for s in slices}) == 2


def test_two_extender_replicas_binding_at_once_never_overcommit(pods: Pods) -> None:
    # node-b holds 40 + 24 + 24 GiB: eight 10 GiB pods fit (4 + 2 + 2), ten are asked for at once,
    # half through each kube-scheduler and its own extender replica
    names = [
        pods.create(pod_manifest(pods.name("race"), ({RESOURCE_MEM: 10},), node="node-b",
                                 scheduler=SECOND_SCHEDULER if i % 2 else None))
        for i in range(10)
    ]  # fmt: skip

    inventory = pods.cluster.node_inventory("node-b")

    def placed_within_capacity() -> list[str]:
        """The pods bound and holding their cards, after checking that no card holds more than it has."""
        live = [pod for pod in map(pods.get, names) if pod["spec"].get("nodeName") and holds_resources(pod)]
        used: dict[str, int] = defaultdict(int)
        for pod in live:
            for slices in pods.allocation(pod["metadata"]["name"]).values():
                for s in slices:
                    used[s.uuid] += s.units
        for card in inventory.cards:
            assert used[card.uuid] <= inventory.units_of(card), f"card {card.index} over-committed: {dict(used)}"
        return [pod["metadata"]["name"] for pod in live]

    placed = wait_until(lambda: len(live := placed_within_capacity()) == 8 and live, 60, "eight pods placed", API_POLL)
    for name in placed:
        pods.wait_running(name)
        assert_sees_assigned_cards(pods, name)
    assert len(placed_within_capacity()) == 8
    assert sorted(set(names) - set(placed)) == sorted(n for n in names if not pods.get(n)["spec"].get("nodeName"))


def test_a_pod_with_only_the_original_alibaba_annotations_runs_on_its_card(pods: Pods) -> None:
    # as the original extender leaves a pod: its five annotations, then bound to the node
    inventory = pods.cluster.node_inventory("node-b")
    card = inventory.cards[1]
    manifest = pod_manifest(
        pods.name("alibaba"),
        ({RESOURCE_MEM: 6},),
        annotations={
            ANN_MEM_IDX: str(card.index),
            ANN_MEM_POD: "6",
            ANN_MEM_DEV: str(inventory.units_of(card)),
            ANN_MEM_ASSIGNED: "false",
            ANN_MEM_ASSUME_TIME: format_assume_time(1_700_000_000_000_000_000),
        },
    )
    manifest["spec"].pop("nodeSelector", None)
    manifest["spec"]["nodeName"] = "node-b"
    name = pods.create(manifest)
    pods.wait_running(name)
    env = pods.env(name)
    assert env[ENV_VISIBLE_DEVICES] == card.uuid
    assert env[ENV_MEM_IDX] == str(card.index)
    assert env[ENV_MEM_CONTAINER] == "6"


def test_a_pod_asking_for_cpu_1e30_is_refused_alone_and_gpu_pods_still_run(pods: Pods) -> None:
    """The API server accepts ``cpu: 1e30`` and kube-scheduler places a pod without GPUs asking for it
    (the extender's filter is not asked about such a pod); the extender must go on placing GPU pods."""
    plain = pod_manifest(pods.name("huge-cpu"), ({},), node="node-a")
    plain["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1e30"}}
    plain = pods.create(plain)
    wait_until(lambda: pods.get(plain)["spec"].get("nodeName"), 60, f"{plain} bound", API_POLL)
    gpu = pods.create(pod_manifest(pods.name("beside-huge"), ({RESOURCE_MEM: 4},), node="node-a"))
    pods.wait_running(gpu)
    assert_sees_assigned_cards(pods, gpu)
    asking = pod_manifest(pods.name("huge-gpu"), ({RESOURCE_MEM: 4},), node="node-a")
    asking["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "1e30"}
    asking = pods.create(asking)
    reason = f"pod default/{asking} container 'main' resources.requests.cpu: '1e30' is more than"
    selector = f"involvedObject.name={asking},reason=FailedScheduling"

    def refused() -> bool:
        return any(
            reason in (e.message or "")
            for e in pods.core.list_namespaced_event("default", field_selector=selector).items
        )

    wait_until(refused, 60, f"{asking}'s FailedScheduling event to say {reason!r}", API_POLL)
    assert not pods.get(asking)["spec"].get("nodeName")
