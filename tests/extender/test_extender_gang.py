"""Gangs through the extender's HTTP verbs, with the API stand-in: n1 has 2 x A100-80GB and a T4,
n2 one A10 (24 GiB)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import wait_until
from gpushare.extender.wiring import start_extender
from kubernetes import client
from podfactory import container, gpu_pod
from test_extender import NODES, Cluster, pod_events

from gpushare.contract.cardrule import card_rule_annotations
from gpushare.contract.gang import format_gang, parse_gang
from gpushare.contract.names import ANN_GANG_HOLD, ANN_GANG_RETRY, NODE_ANN_PENDING_BINDS
from gpushare.contract.pending import parse_pending_binds
from gpushare.placement import ANY_CARD, CardRule


@pytest.fixture
def cluster(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> Iterator[Cluster]:
    cl = Cluster(kube_api, core_v1)
    yield cl
    cl.extender.stop()


def member(cluster: Cluster, name: str, gang: str, minimum: int, gib: int = 40, rule: CardRule = ANY_CARD) -> dict:
    pod = gpu_pod(name, [container("main", gib)], node=None)
    pod["metadata"]["labels"] = format_gang(gang, minimum)
    pod["metadata"].setdefault("annotations", {}).update(card_rule_annotations(rule))
    return cluster.pod(pod)


def seen(cluster: Cluster, pods: list[dict]) -> list[dict]:
    """``pods`` (members of one gang) once the extender's gang index has them all."""
    gang = parse_gang(pods[0])
    wait_until(lambda: len(cluster.extender.gangs.index.members(gang)) >= len(pods), what="the members in the index")
    return pods


def holds(cluster: Cluster, node: str = "n1") -> dict:
    annotations = cluster.core.read_node(node).metadata.annotations or {}
    return {uid: e for uid, e in parse_pending_binds(annotations.get(NODE_ANN_PENDING_BINDS)).items() if e.gang}


def reason(result: dict) -> str:
    reasons = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    assert result["NodeNames"] == [] and set(reasons) == set(NODES), result
    (text,) = set(reasons.values())
    return text


def test_a_gang_short_of_members_waits_and_says_how_many(cluster: Cluster) -> None:
    pods = seen(cluster, [member(cluster, f"w{i}", "train", 3) for i in range(2)])
    assert reason(cluster.filter(pods[0])) == "gang train: 2 of 3 members present, waiting for 1 more"
    assert holds(cluster) == {}
    assert "no cards are held" in cluster.bind(pods[0], "n1")["Error"]


def test_a_members_event_follows_the_gang_as_its_reason_changes(cluster: Cluster) -> None:
    first = seen(cluster, [member(cluster, "w0", "train", 4, gib=60)])[0]
    assert reason(cluster.filter(first)) == "gang train: 1 of 4 members present, waiting for 3 more"
    wait_until(lambda: pod_events(cluster, first), what="the member's event")
    # 60 GiB members: one on each A100, so 2 of 4 can be placed
    seen(cluster, [first] + [member(cluster, f"w{i}", "train", 4, gib=60) for i in range(1, 4)])
    now = reason(cluster.filter(first))
    assert now.startswith("gang train: 4 members present, 2 can be placed, 4 needed")
    wait_until(lambda: len(pod_events(cluster, first)) == 2, what="the member's second event")
    # a new Event with the new reason, not the first one counted again
    assert set(pod_events(cluster, first)) == {
        ("GPUUnschedulable", "gang train: 1 of 4 members present, waiting for 3 more"),
        ("GPUUnschedulable", now),
    }


def test_a_gang_that_cannot_all_fit_holds_nothing_and_small_pods_still_run(cluster: Cluster) -> None:
    # 40 GiB members: two on each A100, none on the T4 or the A10, so 4 of 5 can be placed
    pods = seen(cluster, [member(cluster, f"w{i}", "big", 5) for i in range(5)])
    for pod in pods:
        assert reason(cluster.filter(pod)) == (
            "gang big: 5 members present, 4 can be placed, 5 needed "
            "(default/w4: node n2: no single card has 40 GiB free (largest free: 24 GiB on card 0))"
        )
    assert holds(cluster) == {}
    small = cluster.pod(gpu_pod("small", [container("main", 70)], node=None))
    assert cluster.filter(small)["NodeNames"] == ["n1"]


def marks(cluster: Cluster, *names: str, key: str = ANN_GANG_HOLD) -> dict[str, str | None]:
    """Each pod's annotation ``key`` (``gpushare.io/gang-hold`` unless said), as the API server has it."""
    pods = {name: cluster.core.read_namespaced_pod(name, "default") for name in names}
    return {name: (pod.metadata.annotations or {}).get(key) for name, pod in pods.items()}


def test_a_gang_waiting_for_room_is_nudged_when_a_bound_pod_goes(cluster: Cluster) -> None:
    # a 70 GiB pod on one A100 leaves room for two 40 GiB members (on the other A100): three can't all fit
    blocker = cluster.pod(gpu_pod("blocker", [container("main", 70)], node=None))
    assert cluster.filter(blocker)["NodeNames"] == ["n1"] and cluster.bind(blocker, "n1")["Error"] == ""
    short = seen(cluster, [member(cluster, f"s{i}", "short", 3) for i in range(2)])
    assert "waiting for 1 more" in reason(cluster.filter(short[0]))  # missing members, not room: no nudge
    pods = seen(cluster, [member(cluster, f"w{i}", "trio", 3) for i in range(3)])
    for pod in pods:
        assert reason(cluster.filter(pod)).startswith("gang trio: 3 members present, 2 can be placed, 3 needed")
    assert marks(cluster, "w0", "w1", "w2", key=ANN_GANG_RETRY) == {"w0": None, "w1": None, "w2": None}
    # gone (as kubelet removes it, with no grace left, once its containers have stopped)
    cluster.core.delete_namespaced_pod("blocker", "default", grace_period_seconds=0)
    nudged = wait_until(
        lambda: [n for n, mark in marks(cluster, "w0", "w1", "w2", key=ANN_GANG_RETRY).items() if mark],
        what="a member nudged",
    )
    assert nudged == ["w2"], "the member refused last is the one marked"
    assert marks(cluster, "s0", "s1", key=ANN_GANG_RETRY) == {"s0": None, "s1": None}
    # its retry finds the room, holds the plan and marks the others through their gang-hold
    assert cluster.filter(pods[2])["NodeNames"] == ["n1"]
    assert len(holds(cluster)) == 3


def test_a_feasible_gang_holds_its_cards_until_bound_and_releases_them_when_deleted(cluster: Cluster) -> None:
    pods = seen(cluster, [member(cluster, f"w{i}", "trio", 3) for i in range(3)])
    first = cluster.filter(pods[0])
    assert first["NodeNames"] == ["n1"], first
    held = holds(cluster)
    assert {e.pod for e in held.values()} == {"default/w0", "default/w1", "default/w2"}
    assert sorted(sum(e.held.values()) for e in held.values()) == [40, 40, 40]
    # the held cards count against any other pod: 120 of 160 GiB held, no card has 50 GiB left
    other = cluster.pod(gpu_pod("other", [container("main", 50)], node=None))
    wait_until(lambda: "n1" in cluster.filter(other)["FailedNodes"], what="the holds in the cache")
    assert cluster.bind(other, "n1")["Error"] != ""
    # every member binds onto its held cards
    for pod in pods:
        assert cluster.filter(pod)["NodeNames"] == ["n1"]
        assert cluster.bind(pod, "n1")["Error"] == ""
        hold = held[pod["metadata"]["uid"]]
        assert {s.uuid: s.units for s in cluster.allocation(pod["metadata"]["name"])["main"]} == dict(hold.held)


def test_members_asking_for_a_model_are_held_and_bound_on_cards_of_that_model(cluster: Cluster) -> None:
    # binpack would put 6 GiB members on the T4, the fullest card that fits; they ask for A100s
    a100 = CardRule(models=frozenset({"A100"}))
    pods = seen(cluster, [member(cluster, f"w{i}", "a100s", 2, gib=6, rule=a100) for i in range(2)])
    assert cluster.filter(pods[0])["NodeNames"] == ["n1"]
    models = {card.uuid: card.model for card in cluster.backends["n1"].cards()}
    assert all(models[uuid].startswith("A100") for hold in holds(cluster).values() for uuid in hold.held), models
    for pod in pods:
        assert cluster.filter(pod)["NodeNames"] == ["n1"]
        assert cluster.bind(pod, "n1")["Error"] == ""
        (card,) = cluster.allocation(pod["metadata"]["name"])["main"]
        assert models[card.uuid].startswith("A100"), f"{pod['metadata']['name']} bound to {models[card.uuid]}"


def test_holding_a_plan_marks_the_other_unbound_members_so_kube_scheduler_retries_them(cluster: Cluster) -> None:
    w0, w1, w2 = seen(cluster, [member(cluster, f"w{i}", "trio", 3) for i in range(3)])
    assert cluster.filter(w2)["NodeNames"] == ["n1"]
    # the filtered member is on its way to bind; the other two are changed, which kube-scheduler retries
    assert marks(cluster, "w0", "w1", "w2") == {"w0": "n1", "w1": "n1", "w2": None}
    assert cluster.bind(w1, "n1")["Error"] == ""
    cluster.core.delete_namespaced_pod("w2", "default")
    wait_until(lambda: cluster.filter(w0)["NodeNames"] == [], what="the deleted member gone from the cache")
    # short of members: the holds go, and so does the unbound member's mark; the bound one is left alone
    assert reason(cluster.filter(w0)) == "gang trio: 2 of 3 members present, waiting for 1 more"
    assert holds(cluster) == {}
    assert marks(cluster, "w0", "w1") == {"w0": None, "w1": "n1"}
    # a new member makes the gang whole again: the unbound member not being filtered is marked again
    (w3,) = seen(cluster, [w0, w1, member(cluster, "w3", "trio", 3)])[2:]
    assert cluster.filter(w3)["NodeNames"] == ["n1"]
    assert marks(cluster, "w0", "w1", "w3") == {"w0": "n1", "w1": "n1", "w3": None}


def test_deleting_members_releases_the_holds(cluster: Cluster) -> None:
    pods = seen(cluster, [member(cluster, f"w{i}", "pair", 2, gib=60) for i in range(2)])
    assert cluster.filter(pods[0])["NodeNames"] == ["n1"]
    other = cluster.pod(gpu_pod("other", [container("main", 60)], node=None))
    wait_until(lambda: "n1" in cluster.filter(other)["FailedNodes"], what="both A100s held")
    cluster.core.delete_namespaced_pod("w1", "default")
    wait_until(lambda: cluster.filter(other)["NodeNames"] == ["n1"], what="the deleted member's card free again")
    # the remaining member is short of its gang: its filter takes its own hold back off the node
    assert reason(cluster.filter(pods[0])) == "gang pair: 1 of 2 members present, waiting for 1 more"
    assert holds(cluster) == {}


def test_two_replicas_agree_on_one_plan_and_never_overcommit(cluster: Cluster) -> None:
    second = start_extender(cluster.api, 0, "binpack", host="127.0.0.1")
    try:
        assert second.cache.wait_synced(5)
        other = Cluster.__new__(Cluster)
        other.api, other.core, other.extender = cluster.api, cluster.core, second
        other.url = f"http://127.0.0.1:{second.server.port}"
        pods = [member(cluster, f"w{i}", "duo", 4, gib=40) for i in range(4)]
        replicas = [cluster, other]
        placed: dict[str, str] = {}
        for i, pod in enumerate(pods):
            replica = replicas[i % 2]
            # the other replica's holds reach this one by its watch; until then it may refuse and retry
            result = wait_until(
                lambda r=replica, p=pod: (answer := r.filter(p))["NodeNames"] and answer,
                what=f"a node for {pod['metadata']['name']}",
            )
            (placed[pod["metadata"]["name"]],) = result["NodeNames"]
            assert replica.bind(pod, placed[pod["metadata"]["name"]])["Error"] == ""
        used: dict[str, int] = {}
        for name in placed:
            for s in cluster.allocation(name)["main"]:
                used[s.uuid] = used.get(s.uuid, 0) + s.units
        assert sorted(used.values()) == [80, 80], used
    finally:
        second.stop()
