"""Gangs through the extender's HTTP verbs, with the API stand-in: n1 has 2 x A100-80GB and a T4,
n2 one A10 (24 GiB)."""

from __future__ import annotations

import pytest
from gpushare.extender import reservations as gang_module
from gpushare.extender.wiring import start_extender
from podfactory import container, gpu_pod
from support.extender import NODES, Cluster, pod_events
from support.waiting import wait_until

from gpushare.contract.cardrule import card_rule_annotations
from gpushare.contract.gang import format_gang, parse_gang
from gpushare.contract.names import ANN_GANG_HOLD, ANN_GANG_RETRY, ANN_RETRY, NODE_ANN_PENDING_BINDS
from gpushare.contract.pending import parse_pending_binds
from gpushare.placement import ANY_CARD, CardRule


def member(
    cluster: Cluster,
    name: str,
    gang: str,
    minimum: int,
    gib: int = 40,
    rule: CardRule = ANY_CARD,
    spec: dict | None = None,
) -> dict:
    pod = gpu_pod(name, [container("main", gib)], node=None)
    pod["spec"].update(spec or {})
    pod["metadata"]["labels"] = format_gang(gang, minimum)
    pod["metadata"].setdefault("annotations", {}).update(card_rule_annotations(rule))
    return cluster.pod(pod)


def seen(cluster: Cluster, pods: list[dict]) -> list[dict]:
    """``pods`` (members of one gang) once the extender's gang index has them all, each filtered once
    over every node, as kube-scheduler does with each pod it takes from its queue: the gang is planned
    only once every member has been offered nodes."""
    gang = parse_gang(pods[0])
    wait_until(lambda: len(cluster.extender.gangs.index.members(gang)) >= len(pods), what="the members in the index")
    for pod in pods:
        cluster.filter(pod)
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
    seen(cluster, [member(cluster, f"w{i}", "train", 4, gib=60) for i in range(1, 4)] + [first])
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


#: a required node affinity no node of the cluster satisfies
NOWHERE = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["nowhere"]}]}]
        }
    }
}


def test_a_member_no_node_admits_keeps_the_rest_of_its_gang_from_being_bound(cluster: Cluster) -> None:
    a = member(cluster, "a", "pair", 2, gib=10)
    b = member(cluster, "b", "pair", 2, gib=10, spec={"affinity": NOWHERE})
    seen(cluster, [a, b])
    for pod in (a, b):
        assert reason(cluster.filter(pod)) == (
            "gang pair: 2 members present, 1 can be placed, 2 needed "
            "(pod default/b may go to none of 2 node(s): node n1 doesn't satisfy the pod's required node affinity)"
        )
    assert holds(cluster) == {}
    assert "no cards are held" in cluster.bind(a, "n1")["Error"]


def test_a_member_kube_scheduler_never_offers_a_node_keeps_its_gang_from_being_planned(cluster: Cluster) -> None:
    """kube-scheduler calls the filter only with nodes its own filters passed: a member that also asks for
    a resource no node has is never offered one, and the extender can't see why."""
    a, b = seen(cluster, [member(cluster, name, "trio", 3, gib=10) for name in ("a", "b")])
    c = member(cluster, "c", "trio", 3, gib=10)
    wait_until(lambda: len(cluster.extender.gangs.index.members(parse_gang(c))) == 3, what="the members")
    for pod in (a, b):
        assert reason(cluster.filter(pod)) == (
            "gang trio: 3 members present, 1 not offered any node by kube-scheduler yet (default/c); "
            "the gang is planned once every member has been"
        )
    assert holds(cluster, "n1") == {} and holds(cluster, "n2") == {}
    assert "no cards are held" in cluster.bind(a, "n1")["Error"]
    # once kube-scheduler offers it nodes, the gang is planned on them only
    assert cluster.filter(c, ["n1"])["NodeNames"] == ["n1"]
    assert [e.pod for e in holds(cluster, "n1").values()] == ["default/c"]


def test_members_go_only_to_nodes_whose_taints_they_tolerate(cluster: Cluster) -> None:
    cluster.core.patch_node("n1", {"spec": {"taints": [{"key": "team", "value": "vision", "effect": "NoSchedule"}]}})
    tolerates = {"tolerations": [{"key": "team", "value": "vision", "effect": "NoSchedule"}]}
    pods = seen(cluster, [member(cluster, f"w{i}", "duo", 2, gib=10) for i in range(2)])

    def tainted() -> object:
        """n1's taints as the cache has them: it holds n1 without a spec until the watch brings the patch."""
        return ((cluster.extender.cache.nodes.get("n1") or {}).get("spec") or {}).get("taints")

    wait_until(tainted, what="the taint in the cache")
    # 10 GiB each: the A10 on n2 takes two, and the tainted n1 is left alone
    assert cluster.filter(pods[0])["NodeNames"] == ["n2"]
    assert holds(cluster, "n1") == {} and len(holds(cluster, "n2")) == 2
    big = seen(cluster, [member(cluster, f"b{i}", "big", 2, gib=20, spec=tolerates) for i in range(2)])
    assert cluster.filter(big[0])["NodeNames"] == ["n1"], "only the tolerating gang gets the tainted node"
    assert cluster.bind(big[0], "n1")["Error"] == ""
    assert "taint 'team'='vision':NoSchedule" in cluster.bind(pods[1], "n1")["Error"]


def test_a_hold_on_a_node_kube_scheduler_does_not_offer_the_member_is_dropped_and_planned_again(
    cluster: Cluster,
) -> None:
    blocker = cluster.pod(gpu_pod("blocker", [container("main", 10)], node=None))
    assert cluster.bind(blocker, "n2")["Error"] == ""  # the A10 has 14 GiB left
    x, y = seen(cluster, [member(cluster, "x", "xy", 2, gib=10), member(cluster, "y", "xy", 2, gib=20)])
    assert cluster.filter(x)["NodeNames"]
    assert {e.pod for e in holds(cluster, "n1").values()} >= {"default/y"}, "y fits only on n1's A100s"
    # kube-scheduler offers y only n2 (its affinity, say, or n1's CPU): the hold on n1 is no use to it
    refused = cluster.filter(y, ["n2"])
    assert refused["NodeNames"] == [] and refused["FailedNodes"]["n2"].startswith(
        "gang xy: 2 members present, 1 can be placed, 2 needed (default/y: node n2: no single card has 20 GiB free"
    )
    assert holds(cluster, "n1") == {} and holds(cluster, "n2") == {}
    cluster.core.delete_namespaced_pod("blocker", "default", grace_period_seconds=0)
    result = wait_until(lambda: (r := cluster.filter(y, ["n2"]))["NodeNames"] and r, what="room for y on n2")
    assert result["NodeNames"] == ["n2"]
    assert [e.pod for e in holds(cluster, "n2").values()] == ["default/y"]
    assert cluster.bind(y, "n2")["Error"] == ""


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
        other = Cluster.beside(cluster, second)
        pods = [member(cluster, f"w{i}", "duo", 4, gib=40) for i in range(4)]
        replicas = [cluster, other]
        # kube-scheduler's calls through one Service reach both replicas: each is asked about every member
        for replica in replicas:
            for pod in pods:
                replica.filter(pod)
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


def test_member_filters_reuse_the_gangs_plan_until_something_changes(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = []
    real = gang_module.plan_gang
    monkeypatch.setattr(gang_module, "plan_gang", lambda *args: plans.append(args) or real(*args))
    # 40 GiB members: 4 of 5 can be placed, so every filter refuses and nothing is written
    pods = seen(cluster, [member(cluster, f"w{i}", "big", 5) for i in range(5)])
    for pod in pods:
        assert "4 can be placed" in reason(cluster.filter(pod))
    first_round = len(plans)
    assert first_round <= len(pods)
    for _ in range(3):
        for pod in pods:
            assert "4 can be placed" in reason(cluster.filter(pod))
    assert len(plans) == first_round, "nothing changed: the gang's plan is reused"
    # a gang whose members all hold cards passes its members without planning again
    trio = seen(cluster, [member(cluster, f"t{i}", "trio", 3, gib=10) for i in range(3)])
    assert cluster.filter(trio[0])["NodeNames"]
    wait_until(lambda: len(cluster.extender.cache.gang_holds("default/trio")) == 3, what="the holds in the cache")
    planned = len(plans)
    for pod in trio:
        assert len(cluster.filter(pod)["NodeNames"]) == 1
    assert len(plans) == planned


def test_a_gang_larger_than_the_cap_is_refused_naming_the_gang_and_the_cap(cluster: Cluster) -> None:
    capped = start_extender(cluster.api, 0, "binpack", host="127.0.0.1", max_gang_members=3)
    try:
        assert capped.cache.wait_synced(5)
        other = Cluster.beside(cluster, capped)
        pods = [member(cluster, f"w{i}", "wide", 2, gib=1) for i in range(4)]
        wait_until(lambda: len(capped.gangs.index.members(parse_gang(pods[0]))) == 4, what="the members")
        assert reason(other.filter(pods[0])) == (
            "gang wide: 4 members present, more than the 3 the extender plans for one gang (its --max-gang-members)"
        )
        assert holds(cluster) == {}
    finally:
        capped.stop()


def test_holds_on_a_node_stop_at_the_pods_it_takes(cluster: Cluster) -> None:
    cluster.core.patch_node_status("n1", {"status": {"allocatable": {"pods": "2"}}})
    wait_until(
        lambda: (cluster.extender.cache.nodes.get("n1").get("status") or {}).get("allocatable"),
        what="n1's pod count in the cache",
    )
    # 10 GiB members: n2's A10 takes two, n1 has cards for many more but room for two pods
    pods = seen(cluster, [member(cluster, f"w{i}", "five", 5, gib=10) for i in range(5)])
    assert reason(cluster.filter(pods[0])).startswith("gang five: 5 members present, 4 can be placed, 5 needed")
    assert holds(cluster, "n1") == {}


def test_gang_holds_never_fill_the_ledger_so_binds_keep_working(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gang_module, "HOLD_BYTES", 600, raising=False)  # one entry with these names, not two
    pods = seen(cluster, [member(cluster, f"{'w' * 200}-{i}", "many", 4, gib=10) for i in range(4)])
    result = cluster.filter(pods[0])
    text = result["FailedNodes"]["n1"]
    assert result["NodeNames"] == [] and result["FailedAndUnresolvableNodes"] == {}, result
    assert text.startswith("gang many: holding the plan's cards failed, will try again (node n")
    assert f"annotation {NODE_ANN_PENDING_BINDS} would take" in text and "more than the 600 gang holds may fill" in text
    assert holds(cluster, "n1") == {} and holds(cluster, "n2") == {}
    plain = cluster.pod(gpu_pod("plain", [container("main", 10)], node=None))
    assert cluster.bind(plain, "n1")["Error"] == ""


def test_a_replica_whose_pod_cache_lags_cannot_overwrite_a_bound_members_entry(cluster: Cluster) -> None:
    second = start_extender(cluster.api, 0, "binpack", host="127.0.0.1")
    try:
        assert second.cache.wait_synced(5)
        other = Cluster.beside(cluster, second)
        w0, w1 = [member(cluster, f"w{i}", "pair", 2, gib=60) for i in range(2)]
        wait_until(lambda: len(second.gangs.index.members(parse_gang(w0))) == 2, what="the members")
        second.cache.pods.stop()  # from here on the second replica sees both members unbound
        assert other.filter(w0)["NodeNames"] == [] and cluster.filter(w1)["NodeNames"] == []  # w1, w0 not offered yet
        assert cluster.filter(w0)["NodeNames"] == ["n1"] and cluster.bind(w0, "n1")["Error"] == ""
        uid = w0["metadata"]["uid"]
        annotations = cluster.core.read_node("n1").metadata.annotations
        recorded = parse_pending_binds(annotations[NODE_ANN_PENDING_BINDS])[uid]
        assert recorded.gang == ""
        wait_until(lambda: uid in second.cache.ledger("n1"), what="the bind in the second replica's node cache")
        result = other.filter(w1)
        assert result["NodeNames"] == [] and "member(s) default/w0 were bound meanwhile" in result["FailedNodes"]["n1"]
        annotations = cluster.core.read_node("n1").metadata.annotations
        assert parse_pending_binds(annotations[NODE_ANN_PENDING_BINDS])[uid] == recorded
    finally:
        second.stop()


def test_a_single_pod_refused_for_room_is_marked_for_a_retry_when_room_frees_on_a_node_it_was_refused(
    cluster: Cluster,
) -> None:
    """kube-scheduler retries the pod on the deletion itself, possibly before the extender's cache has
    it, and then (1.27+) not again for 5 minutes: the extender marks the pod once its cache has it."""
    blocker = cluster.pod(gpu_pod("blocker", [container("main", 20)], node=None))
    assert cluster.bind(blocker, "n2")["Error"] == ""  # the A10 has 4 GiB left
    waiting = cluster.pod(gpu_pod("waiting", [container("main", 10)], node=None))
    malformed = gpu_pod("malformed", [container("main", 10)], node=None)
    malformed["metadata"]["annotations"] = {"gpushare.io/require-nvlink": "maybe"}
    malformed = cluster.pod(malformed)
    # kube-scheduler offers only n2 (the pod's affinity, say): refused there for want of room
    assert "no single card has 10 GiB free" in cluster.filter(waiting, ["n2"])["FailedNodes"]["n2"]
    assert cluster.filter(malformed, ["n2"])["NodeNames"] == []  # refused for its annotation, not for room
    assert marks(cluster, "waiting", "malformed", key=ANN_RETRY) == {"waiting": None, "malformed": None}
    cluster.core.delete_namespaced_pod("blocker", "default", grace_period_seconds=0)
    wait_until(lambda: marks(cluster, "waiting", key=ANN_RETRY)["waiting"], what="the waiting pod marked")
    assert marks(cluster, "malformed", key=ANN_RETRY) == {"malformed": None}
    # the retry the mark causes sees the room
    assert cluster.filter(waiting, ["n2"])["NodeNames"] == ["n2"]
