"""The scheduler extender over HTTP, with request bodies shaped exactly as kube-scheduler sends them.

The extender's wire contract: bodies exactly as kube-scheduler sends and reads them (docs/extender.md),
and pod annotations the original gpushare device plugin can match (docs/operations.md, "What the original
components read from pods gpushare placed")."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from gpushare.advertiser.agent import Advertiser
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.wiring import RunningExtender, start_extender
from kubernetes import client
from podfactory import container, gpu_pod
from support.extender import NODES, Cluster, host_scores, pod_events
from support.original import original_inspect_usage, original_node
from support.waiting import readiness, wait_until

from gpushare.cards import Card
from gpushare.contract import names
from gpushare.contract.aliyun import format_framework_allocation
from gpushare.contract.allocation import CardSlice, format_allocation, parse_allocation, validate_allocation
from gpushare.contract.errors import AnnotationError, ContractError
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.pending import PendingBind, format_pending_binds, parse_pending_binds
from gpushare.contract.request import parse_pod_request
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.holdings.node import node_usage
from gpushare.holdings.pod import held_units, pod_allocation
from gpushare.kube.objects import get_pod, list_nodes
from gpushare.sandbox import apiserver as standin


def test_filter_node_names_mode_with_reasons(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("big", [container("main", 30)]))
    result = cluster.filter(pod)
    assert result["NodeNames"] == ["n1"] and result["Error"] == ""
    assert result["FailedNodes"] == {"n2": "no single card has 30 GiB free (largest free: 24 GiB on card 0)"}


def test_filter_full_nodes_mode_returns_node_objects(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("small", [container("main", 20)]))
    nodes = cluster.api.sanitize_for_serialization(cluster.core.list_node())
    result = cluster.post("filter", {"Pod": pod, "Nodes": nodes})
    assert sorted(n["metadata"]["name"] for n in result["Nodes"]["items"]) == ["n1", "n2"]


def test_unknown_node_and_indivisible_request_are_unresolvable(cluster: Cluster) -> None:
    result = cluster.filter(cluster.pod(gpu_pod("x", [container("main", 8)])), ["n1", "ghost"])
    assert "ghost" in result["FailedAndUnresolvableNodes"]
    odd = cluster.pod(gpu_pod("odd", [container("main", 9, 2)]))
    reasons = cluster.filter(odd)["FailedAndUnresolvableNodes"]
    assert set(reasons) == {"n1", "n2"} and "not divisible" in reasons["n1"]


def test_no_gpu_pod_is_placed_on_a_node_whose_kubelet_is_not_watching_its_device_plugin(cluster: Cluster) -> None:
    """A kubelet restarting could admit the pod before the plugin registered with it, and fail it for good."""

    def watching(value: str) -> None:
        cluster.core.patch_node("n2", {"metadata": {"annotations": {names.NODE_ANN_KUBELET_WATCHING: value}}})

    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    watching("false")
    wait_until(lambda: cluster.extender.cache.view("n2") is None, what="n2 held off in the cache")
    result = cluster.filter(pod)
    assert result["NodeNames"] == ["n1"]
    assert "no kubelet is watching its gpushare device plugin" in result["FailedAndUnresolvableNodes"]["n2"]
    refused = cluster.bind(pod, "n2")["Error"]
    assert "no kubelet is watching its gpushare device plugin" in refused, refused
    watching("true")
    wait_until(lambda: cluster.extender.cache.view("n2") is not None, what="n2 back in the cache")
    assert cluster.filter(pod)["NodeNames"] == ["n1", "n2"]


def test_unhealthy_card_is_never_used(cluster: Cluster) -> None:
    backend = cluster.backends["n2"]
    backend.inject_xid(backend.cards()[0].uuid, 79)
    Advertiser(cluster.api, "n2", backend, GIB).publish_once()
    wait_until(lambda: not cluster.extender.cache.view("n2").cards[0].healthy, what="the unhealthy card in the cache")
    result = cluster.filter(cluster.pod(gpu_pod("p", [container("main", 4)])))
    assert result["NodeNames"] == ["n1"] and result["FailedNodes"]["n2"] == "no healthy card (1 unhealthy)"


def test_prioritize_scores_in_range_and_binpack_prefers_the_fuller_node(cluster: Cluster) -> None:
    first = cluster.pod(gpu_pod("first", [container("main", 10)]))
    assert cluster.bind(first, "n2")["Error"] == ""
    wait_until(lambda: cluster.extender.cache.view("n2").cards[0].used == 10, what="the bind in the cache")
    scores = cluster.post(
        "prioritize", {"Pod": cluster.pod(gpu_pod("next", [container("main", 4)])), "NodeNames": ["n1", "n2"]}
    )
    by_host = host_scores(scores, ["n1", "n2"])
    assert by_host["n2"] > by_host["n1"]


def test_bind_writes_all_annotations_compatible_with_the_original_plugin(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("p", [container("a", 6), container("b", 2)]))
    assert cluster.bind(pod, "n1")["Error"] == ""
    got = cluster.core.read_namespaced_pod("p", "default")
    ann = got.metadata.annotations
    assert got.spec.node_name == "n1"
    assert ann[names.ANN_MEM_ASSIGNED] == "false"
    assert int(ann[names.ANN_MEM_ASSUME_TIME]) > 1_600_000_000 * 10**9  # nanoseconds
    assert ann[names.ANN_MEM_POD] == "8"  # the pod's total, as the original plugin matches on
    alloc = parse_allocation(ann[names.ANN_ALLOCATION])
    assert set(alloc) == {"a", "b"}
    first = alloc["a"][0]
    cards = {card.uuid: card for card in cluster.backends["n1"].cards()}
    assert ann[names.ANN_MEM_IDX] == str(cards[first.uuid].minor)  # the original components number cards by minor
    # what the original extender takes each card to hold: the node's total over its cards
    assert ann[names.ANN_MEM_DEV] == str(sum(card.memory_mib // 1024 for card in cards.values()) // len(cards))


def test_a_bind_records_which_cards_the_pod_got_in_an_event(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("p", [container("main", 6)]))
    assert cluster.bind(pod, "n2")["Error"] == ""

    def events() -> list[tuple[str, str]]:
        listed = cluster.core.list_namespaced_event("default").items
        return [(e.reason, e.message) for e in listed if e.involved_object.uid == pod["metadata"]["uid"]]

    wait_until(events, what="the pod's event")
    assert events() == [("GPUAssigned", "node n2: main: card 0 (6 GiB)")]


@pytest.mark.parametrize(
    ("annotations", "containers", "said"),
    [
        ({names.ANN_REQUIRE_NVLINK: "maybe"}, [container("main", 8)], names.ANN_REQUIRE_NVLINK),
        ({}, [container("main", 5, 2)], "not divisible"),
    ],
)
def test_a_malformed_request_is_refused_everywhere_with_its_reason_logged_and_recorded(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, annotations: dict, containers: list, said: str
) -> None:
    pod = cluster.pod(gpu_pod("bad", containers, extra_annotations=annotations))
    with caplog.at_level(logging.INFO, logger="gpushare.extender"):
        result = cluster.filter(pod)
    (reason,) = set(result["FailedAndUnresolvableNodes"].values())
    assert "default/bad" in reason and said in reason
    # in FailedNodes too, which is all a scheduler that ignores the other map reads
    assert result["NodeNames"] == [] and result["Error"] == ""
    assert result["FailedNodes"] == result["FailedAndUnresolvableNodes"] == dict.fromkeys(NODES, reason)
    assert [r.getMessage() for r in caplog.records if "default/bad" in r.getMessage()] == [
        f"filter pod default/bad: no node fits: {reason}"
    ]
    wait_until(lambda: pod_events(cluster, pod), what="the pod's event")
    assert pod_events(cluster, pod) == [("GPUUnschedulable", reason)]


def test_a_node_without_an_inventory_is_refused_with_its_reason_in_both_maps(cluster: Cluster) -> None:
    cluster.core.create_node({"metadata": {"name": "bare"}})
    wait_until(lambda: "not known" not in (cluster.extender.cache.problem("bare") or ""), what="the node in the cache")
    pod = cluster.pod(gpu_pod("p", [container("main", 8)]))
    result = cluster.filter(pod, ["bare"])
    reason = result["FailedAndUnresolvableNodes"]["bare"]
    assert reason.startswith("node bare has no ") and result["FailedNodes"] == {"bare": reason}
    wait_until(lambda: pod_events(cluster, pod), what="the pod's event")
    assert pod_events(cluster, pod) == [("GPUUnschedulable", reason)]


def test_two_card_pod_gets_two_nvlinked_cards(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("pair", [container("main", 16, 2)]))
    assert cluster.filter(pod)["NodeNames"] == ["n1"]
    assert cluster.bind(pod, "n1")["Error"] == ""
    a0, a1, _ = cluster.backends["n1"].cards()
    assert {s.uuid for s in cluster.allocation("pair")["main"]} == {a0.uuid, a1.uuid}
    assert all(s.units == 8 for s in cluster.allocation("pair")["main"])


def test_exclusive_count_only_pod_takes_a_whole_free_card(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("whole", [container("main", 0, 1)]))
    assert cluster.bind(pod, "n2")["Error"] == ""
    assert cluster.allocation("whole")["main"][0].units == 24
    again = cluster.filter(cluster.pod(gpu_pod("more", [container("main", 1)])), ["n2"])
    assert again["NodeNames"] == []


def test_concurrent_bind_storm_never_overcommits(cluster: Cluster) -> None:
    pods = [cluster.pod(gpu_pod(f"s{i:02d}", [container("main", 5)])) for i in range(50)]
    results: list[dict] = []
    lock = threading.Lock()

    def bind(pod: dict) -> None:
        reply = cluster.bind(pod, "n1")
        with lock:
            results.append(reply)

    threads = [threading.Thread(target=bind, args=(p,)) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    bound = [r for r in results if not r["Error"]]
    # 16 + 16 + 3 pods of 5 GiB fit on 80 + 80 + 15 GiB
    assert len(bound) == 35 and len(results) == 50
    assert all("no single card has 5 GiB free" in r["Error"] for r in results if r["Error"])
    pods_now = cluster.api.sanitize_for_serialization(cluster.core.list_namespaced_pod("default"))["items"]
    cards = cluster.backends["n1"].cards()
    used, _, bad = node_usage([p for p in pods_now if p["spec"].get("nodeName") == "n1"], NodeInventory(GIB, cards))
    assert not bad and all(used[card.uuid] <= card.memory_mib // 1024 for card in cards)


def test_binds_waiting_on_one_node_are_recorded_by_one_write_and_never_overcommit(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods = [cluster.pod(gpu_pod(f"w{i}", [container("main", 30)])) for i in range(7)]
    for pod in pods:
        wait_until(lambda p=pod: cluster.extender.cache.pods.get(p["metadata"]["name"], "default"), what="the pods")
    writes: list[str] = []
    original = standin._Handler._send

    def record(self: standin._Handler, code: int, body: Any) -> None:
        if self.command == "PATCH" and self.path.startswith("/api/v1/nodes/"):
            writes.append(self.path)
        original(self, code, body)

    monkeypatch.setattr(standin._Handler, "_send", record)
    replies: list[dict] = []
    binder = cluster.extender.binder
    with binder.node_lock("n1"):  # a bind onto n1 under way: the others wait for it
        threads = [threading.Thread(target=lambda p=p: replies.append(cluster.bind(p, "n1"))) for p in pods]
        for thread in threads:
            thread.start()
        wait_until(lambda: binder.waiting_on("n1") == len(pods), what="every bind waiting for n1")
    for thread in threads:
        thread.join(30)
    # 30 GiB pods: two on each A100 (80 GiB), none on the T4 (15 GiB)
    assert sorted(r["Error"] == "" for r in replies) == [False] * 3 + [True] * 4
    assert all("no single card has 30 GiB free" in r["Error"] for r in replies if r["Error"])
    assert len(writes) == 1
    cards = cluster.backends["n1"].cards()
    listed = cluster.api.sanitize_for_serialization(cluster.core.list_namespaced_pod("default"))["items"]
    used, _, bad = node_usage([p for p in listed if p["spec"].get("nodeName") == "n1"], NodeInventory(GIB, cards))
    assert not bad and all(used[card.uuid] <= card.memory_mib // 1024 for card in cards)


def test_a_bind_another_replica_recorded_on_the_node_counts_until_its_pod_is_gone(cluster: Cluster) -> None:
    # another replica has bumped node n2 for its pod "other" (20 of the A10's 24 GiB) and not yet bound it
    other = cluster.pod(gpu_pod("other", [container("main", 20)]))
    a10 = cluster.backends["n2"].cards()[0].uuid
    pending = {other["metadata"]["uid"]: PendingBind("default/other", {a10: 20}, time.time())}
    cluster.core.patch_node(
        "n2", {"metadata": {"annotations": {names.NODE_ANN_PENDING_BINDS: format_pending_binds(pending)}}}
    )
    pod = cluster.pod(gpu_pod("p", [container("main", 8)]))
    assert "no single card has 8 GiB free" in cluster.bind(pod, "n2")["Error"]
    cluster.core.delete_namespaced_pod("other", "default")
    assert cluster.bind(pod, "n2")["Error"] == ""
    recorded = parse_pending_binds(cluster.core.read_node("n2").metadata.annotations[names.NODE_ANN_PENDING_BINDS])
    assert list(recorded) == [pod["metadata"]["uid"]] and recorded[pod["metadata"]["uid"]].held == {a10: 8}


def test_a_replica_whose_caches_lag_never_overcommits(cluster: Cluster) -> None:
    """A bind places from the replica's watch caches; the node's compare-and-swap catches a stale node,
    and the node's ledger holds the binds the stale pod cache misses."""
    second = start_extender(cluster.api, 0, "binpack", host="127.0.0.1")
    try:
        other = Cluster.beside(cluster, second)
        assert second.cache.wait_synced(5)
        wait_until(lambda: second.cache.view("n1"), what="n1 in the second replica's cache")
        second.cache.nodes.stop()  # from here on it sees n1 as it was, with every card free
        second.cache.pods.stop()
        first = cluster.pod(gpu_pod("first", [container("main", 70)]))
        assert cluster.bind(first, "n1")["Error"] == ""
        late = other.pod(gpu_pod("late", [container("main", 70)]))
        assert other.bind(late, "n1")["Error"] == ""
        third = other.pod(gpu_pod("third", [container("main", 70)]))
        assert "no single card has 70 GiB free" in other.bind(third, "n1")["Error"]
        cards = [s.uuid for name in ("first", "late") for s in cluster.allocation(name)["main"]]
        assert len(set(cards)) == 2
    finally:
        second.stop()


def test_a_bind_reads_nothing_from_the_api_server_and_writes_the_node_and_the_binding(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What binding a GPU pod costs the API server (an Event follows, written in the background)."""
    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    wait_until(lambda: cluster.extender.cache.pods.get("p", "default"), what="the pod in the cache")
    requests: list[str] = []
    original = standin._Handler._send

    def record(self: standin._Handler, code: int, body: Any) -> None:
        if "watch=" not in self.path and "/events" not in self.path:
            requests.append(f"{self.command} {self.path.split('?')[0]}")
        original(self, code, body)

    monkeypatch.setattr(standin._Handler, "_send", record)
    assert cluster.bind(pod, "n1")["Error"] == ""
    assert requests == ["PATCH /api/v1/nodes/n1", "POST /api/v1/namespaces/default/pods/p/binding"]
    # a pod that ended leaves its entry in the node's ledger; the next bind drops it, reading nothing
    cluster.core.delete_namespaced_pod("p", "default", grace_period_seconds=0)
    wait_until(lambda: cluster.extender.cache.gone(pod["metadata"]["uid"]), what="the deletion in the cache")
    after = cluster.pod(gpu_pod("after", [container("main", 4)]))
    wait_until(lambda: cluster.extender.cache.pods.get("after", "default"), what="the pod in the cache")
    requests.clear()
    assert cluster.bind(after, "n1")["Error"] == ""
    assert requests == ["PATCH /api/v1/nodes/n1", "POST /api/v1/namespaces/default/pods/after/binding"]
    ledger = parse_pending_binds(cluster.core.read_node("n1").metadata.annotations[names.NODE_ANN_PENDING_BINDS])
    assert list(ledger) == [after["metadata"]["uid"]]


def test_failed_binding_takes_the_assignment_back(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    cluster.core.create_namespaced_pod_binding(
        "p",
        "default",
        client.V1Binding(metadata=client.V1ObjectMeta(name="p"), target=client.V1ObjectReference(name="n2")),
        _preload_content=False,
    )
    reply = cluster.bind(pod, "n1")
    # refused before anything is placed once the cache shows the binding, else by the API server's 409
    assert "bound to node n2" in reply["Error"], reply
    assert names.ANN_ALLOCATION not in (cluster.core.read_namespaced_pod("p", "default").metadata.annotations or {})
    assert cluster.extender.cache.assumed_on("n1") == []


def test_cache_is_rebuilt_after_a_restart_and_counts_original_pods(cluster: Cluster) -> None:
    a = cluster.pod(gpu_pod("ours", [container("main", 70)]))
    assert cluster.bind(a, "n1")["Error"] == ""
    legacy = gpu_pod("legacy", [container("main", 75)], original_index=1)
    cluster.core.create_namespaced_pod("default", legacy)
    cluster.extender.stop()
    cluster.extender = start_extender(cluster.api, 0, "binpack", host="127.0.0.1")
    cluster.url = f"http://127.0.0.1:{cluster.extender.server.port}"
    assert cluster.extender.cache.wait_synced(5)
    wait_until(lambda: cluster.extender.cache.view("n1") and cluster.extender.cache.view("n1").cards[1].used == 75)
    used = [card.used for card in cluster.extender.cache.view("n1").cards]
    assert sorted(used) == [0, 70, 75]
    result = cluster.filter(cluster.pod(gpu_pod("p", [container("main", 16)])), ["n1"])
    assert result["FailedNodes"]["n1"] == "no single card has 16 GiB free (largest free: 15 GiB on card 2)"
    cluster.core.delete_namespaced_pod("legacy", "default", grace_period_seconds=0)
    wait_until(lambda: cluster.extender.cache.view("n1").cards[1].used == 0, what="the deletion in the cache")
    cluster.core.patch_namespaced_pod_status("ours", "default", {"status": {"phase": "Succeeded"}})
    wait_until(lambda: all(card.used == 0 for card in cluster.extender.cache.view("n1").cards), what="completion")


def test_preempt_keeps_only_nodes_where_eviction_helps_and_drops_needless_victims(cluster: Cluster) -> None:
    big = cluster.pod(gpu_pod("big", [container("main", 20)]))
    small = cluster.pod(gpu_pod("small", [container("main", 4)]))
    assert cluster.bind(big, "n2")["Error"] == "" and cluster.bind(small, "n2")["Error"] == ""
    t4hog = cluster.pod(gpu_pod("t4hog", [container("main", 15)]))
    assert cluster.bind(t4hog, "n1")["Error"] == ""
    preemptor = cluster.pod(gpu_pod("urgent", [container("main", 18)]))
    victims = {
        "n2": {"Pods": [{"UID": big["metadata"]["uid"]}, {"UID": small["metadata"]["uid"]}], "NumPDBViolations": 0},
        "n1": {"Pods": [{"UID": t4hog["metadata"]["uid"]}], "NumPDBViolations": 1},
    }
    result = cluster.post("preempt", {"Pod": preemptor, "NodeNameToMetaVictims": victims})["NodeNameToMetaVictims"]
    # n1 already fits (an A100 is free), so the T4 victim isn't needed; on n2 evicting "big" frees 20 GiB
    # of the 24 GiB card, enough for 18: "small" may stay
    assert result["n1"] == {"Pods": [], "NumPDBViolations": 1}
    assert result["n2"] == {"Pods": [{"UID": big["metadata"]["uid"]}], "NumPDBViolations": 0}
    huge = cluster.pod(gpu_pod("huge", [container("main", 60)]))
    only_n2 = cluster.post("preempt", {"Pod": huge, "NodeNameToMetaVictims": {"n2": victims["n2"]}})
    assert only_n2["NodeNameToMetaVictims"] == {}


def test_bad_input_gives_400_or_error_and_never_kills_the_server(cluster: Cluster) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        cluster.post("filter", None, raw=b"{not json")
    assert err.value.code == 400 and "bad request" in json.loads(err.value.read())["Error"]
    with pytest.raises(urllib.error.HTTPError) as err:
        cluster.post("filter", {"NodeNames": ["n1"]})
    assert err.value.code == 400
    reply = cluster.post("bind", {"PodName": "ghost", "PodNamespace": "default", "PodUID": "u", "Node": "n1"})
    assert "pod default/ghost" in reply["Error"] and "not found" in reply["Error"]
    with urllib.request.urlopen(f"{cluster.url}/healthz", timeout=5) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{cluster.url}/inspect/n1", timeout=5) as reply:
        cards = json.loads(reply.read())["nodes"]["n1"]["cards"]
    assert [card["capacity"] for card in cards] == [80, 80, 15]
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    assert "gpushare_extender_verb_seconds" in body
    assert 'gpushare_extender_card_total_units{card="2",model="T4",node="n1"} 15.0' in body


def test_ready_only_once_the_rows_and_costs_are_built(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    core_v1.create_node({"metadata": {"name": "n1"}})
    Advertiser(kube_api, "n1", SimulatedBackend("n1", NODES["n1"]), GIB).publish_once()
    warming, release = threading.Event(), threading.Event()
    warm = PlacementEngine.warm

    def held(engine: PlacementEngine) -> None:
        warming.set()
        release.wait()
        warm(engine)

    monkeypatch.setattr(PlacementEngine, "warm", held)
    running = start_extender(kube_api, 0, "fgd", host="127.0.0.1")
    url = f"http://127.0.0.1:{running.server.port}"
    try:
        assert warming.wait(5) and running.cache.synced
        assert readiness(url) == 503
        release.set()
        wait_until(lambda: readiness(url) == 200, what="readiness once the warm-up is done")
    finally:
        release.set()
        running.stop()


def test_a_failed_warm_up_still_ends_in_readiness_and_the_verbs_build_what_they_need(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    core_v1.create_node({"metadata": {"name": "n2"}})
    Advertiser(kube_api, "n2", SimulatedBackend("n2", NODES["n2"]), GIB).publish_once()

    def broken(engine: PlacementEngine) -> None:
        raise RuntimeError("warm-up bug")

    monkeypatch.setattr(PlacementEngine, "warm", broken)
    running = start_extender(kube_api, 0, "fgd", host="127.0.0.1")
    url = f"http://127.0.0.1:{running.server.port}"
    try:
        wait_until(lambda: readiness(url) == 200, what="readiness despite the failed warm-up")
        pod = kube_api.sanitize_for_serialization(
            core_v1.create_namespaced_pod("default", gpu_pod("p", [container("main", 30)], node=None))
        )
        request = urllib.request.Request(
            f"{url}/filter", data=json.dumps({"Pod": pod, "NodeNames": ["n2"]}).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert json.loads(reply.read())["FailedNodes"] == {
                "n2": "no single card has 30 GiB free (largest free: 24 GiB on card 0)"
            }
    finally:
        running.stop()


CONTRACT_NODES = {"mixed": "2xA100-80GB:81920,1xT4:15360", "small": "1xA10:24576"}
FILTER_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


class Extender:
    """The extender with its cluster, reached over one keep-alive connection as kube-scheduler does."""

    def __init__(self, api: client.ApiClient, core: client.CoreV1Api) -> None:
        self.api, self.core = api, core
        self.backends = {name: SimulatedBackend(name, spec) for name, spec in CONTRACT_NODES.items()}
        for name, backend in self.backends.items():
            core.create_node({"metadata": {"name": name}})
            Advertiser(api, name, backend, GIB).publish_once()
        self.running: RunningExtender = start_extender(api, 0, "binpack", host="127.0.0.1")
        assert self.running.cache.wait_synced(5)
        wait_until(
            lambda: all(self.running.cache.view(n) for n in CONTRACT_NODES), what="both inventories in the cache"
        )
        self.conn = http.client.HTTPConnection("127.0.0.1", self.running.server.port, timeout=60)

    def raw(self, verb: str, data: bytes) -> tuple[int, Any]:
        self.conn.request("POST", f"/{verb}", body=data, headers={"Content-Type": "application/json"})
        reply = self.conn.getresponse()
        return reply.status, json.loads(reply.read())

    def call(self, verb: str, body: Any) -> Any:
        status, reply = self.raw(verb, json.dumps(body).encode())
        assert status == 200, reply
        return reply

    def get(self, path: str) -> tuple[int, bytes]:
        self.conn.request("GET", path)
        reply = self.conn.getresponse()
        return reply.status, reply.read()

    def pending(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Create ``pod`` unbound; return the v1.Pod JSON the API serves, as kube-scheduler holds it."""
        pod = {**pod, "spec": {k: v for k, v in pod["spec"].items() if k != "nodeName"}}
        meta = pod["metadata"]
        self.core.create_namespaced_pod(meta["namespace"], pod)
        return get_pod(self.api, meta["namespace"], meta["name"])

    def bind(self, pod: Mapping[str, Any], node: str) -> dict[str, Any]:
        meta = pod["metadata"]
        args = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}
        return self.call("bind", args)

    def annotations(self, name: str) -> dict[str, str]:
        return get_pod(self.api, "default", name)["metadata"].get("annotations") or {}

    def used(self, node: str) -> list[int]:
        status, body = self.get(f"/inspect/{node}")
        assert status == 200
        return [card["used"] for card in json.loads(body)["nodes"][node]["cards"]]


@pytest.fixture
def ext(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> Iterator[Extender]:
    extender = Extender(kube_api, core_v1)
    yield extender
    extender.conn.close()
    extender.running.stop()


def wait_counted(ext: Extender, node: str, used: list[int]) -> None:
    wait_until(lambda: ext.used(node) == used, what=f"card usage {used} on {node} in the extender's cache")


# --- filter ---------------------------------------------------------------------------------------------


def test_filter_in_node_names_mode_answers_with_names_and_reasons(ext: Extender) -> None:
    pod = ext.pending(gpu_pod("big", [container("main", 30)]))
    assert pod["status"]["phase"] == "Pending" and pod["metadata"]["uid"]  # a full v1.Pod, as served
    reply = ext.call("filter", {"Pod": pod, "NodeNames": ["mixed", "small"]})
    assert set(reply) == FILTER_KEYS
    assert reply["NodeNames"] == ["mixed"] and reply["Nodes"] is None and reply["Error"] == ""
    assert reply["FailedNodes"] == {"small": "no single card has 30 GiB free (largest free: 24 GiB on card 0)"}
    # its one card is smaller than the ask: no pod ending there (nor any preemption) makes room
    assert reply["FailedAndUnresolvableNodes"] == reply["FailedNodes"]


def test_filter_in_nodes_mode_returns_the_surviving_node_objects_untouched(ext: Extender) -> None:
    pod = ext.pending(gpu_pod("big", [container("main", 30)]))
    node_list = {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}}
    node_list["items"] = list_nodes(ext.api)
    reply = ext.call("filter", {"Pod": pod, "Nodes": node_list})
    assert set(reply) == FILTER_KEYS and reply["NodeNames"] is None
    (survivor,) = reply["Nodes"]["items"]
    assert survivor == next(n for n in node_list["items"] if n["metadata"]["name"] == "mixed")
    assert reply["Nodes"]["kind"] == "NodeList" and set(reply["FailedNodes"]) == {"small"}


def test_mixed_cards_each_count_with_their_own_memory(ext: Extender) -> None:
    # 70 GiB on each A100 leaves 10 + 10 + 15 free on "mixed": 12 GiB fits only the T4
    for i in range(2):
        holder = ext.pending(gpu_pod(f"holder{i}", [container("main", 70)]))
        assert ext.bind(holder, "mixed")["Error"] == ""
    wait_counted(ext, "mixed", [70, 70, 0])
    pod = ext.pending(gpu_pod("p12", [container("main", 12)]))
    assert ext.call("filter", {"Pod": pod, "NodeNames": ["mixed"]})["NodeNames"] == ["mixed"]
    assert ext.bind(pod, "mixed")["Error"] == ""
    assert parse_allocation(ext.annotations("p12")[names.ANN_ALLOCATION])["main"][0].index == 2
    wait_counted(ext, "mixed", [70, 70, 12])
    too_big = ext.pending(gpu_pod("p11", [container("main", 11)]))
    reply = ext.call("filter", {"Pod": too_big, "NodeNames": ["mixed"]})
    assert reply["FailedNodes"] == {"mixed": "no single card has 11 GiB free (largest free: 10 GiB on card 0)"}


def test_nodes_without_inventory_or_pods_that_can_never_fit_are_unresolvable(ext: Extender) -> None:
    ext.core.create_node({"metadata": {"name": "cpu-only"}})
    wait_until(lambda: "cpu-only" in ext.running.cache.node_names(), what="the plain node in the cache")
    pod = ext.pending(gpu_pod("p", [container("main", 4)]))
    reply = ext.call("filter", {"Pod": pod, "NodeNames": ["small", "cpu-only", "ghost"]})
    assert reply["NodeNames"] == ["small"]
    assert set(reply["FailedAndUnresolvableNodes"]) == {"cpu-only", "ghost"}
    assert (
        "has no gpushare.io/inventory annotation and advertises no aliyun.com/gpu-mem"
        in (reply["FailedAndUnresolvableNodes"]["cpu-only"])
    )


# --- prioritize ------------------------------------------------------------------------------------------


def scores(ext: Extender, pod: Mapping[str, Any], nodes: Sequence[str]) -> dict[str, int]:
    reply = ext.call("prioritize", {"Pod": pod, "NodeNames": list(nodes)})
    assert [entry["Host"] for entry in reply] == [n for n in nodes if n in {e["Host"] for e in reply}]
    return host_scores(reply, nodes)


def test_prioritize_returns_a_host_priority_list_and_honours_the_pod_policy(ext: Extender) -> None:
    holder = ext.pending(gpu_pod("holder", [container("main", 20)]))
    assert ext.bind(holder, "small")["Error"] == ""
    wait_counted(ext, "small", [20])
    packed = scores(ext, ext.pending(gpu_pod("packed", [container("main", 2)])), ["mixed", "small"])
    assert packed["small"] > packed["mixed"]  # binpack, the cluster-wide policy here: the fuller node
    spread_pod = gpu_pod("spread", [container("main", 2)], extra_annotations={names.ANN_POLICY: "spread"})
    spread = scores(ext, ext.pending(spread_pod), ["mixed", "small"])
    assert spread["mixed"] > spread["small"]


# --- bind -------------------------------------------------------------------------------------------------


def original_plugin_pick(pods: Sequence[Mapping[str, Any]], node: str, request: int) -> Mapping[str, Any] | None:
    """The original device plugin's matching rule in Allocate: among the node's Pending
    gpu-mem pods with ASSIGNED == "false", by ASSUME_TIME, the first whose pod total equals the request."""
    candidates = []
    for pod in pods:
        ann = pod["metadata"].get("annotations") or {}
        if pod["spec"].get("nodeName") != node or pod["status"].get("phase") != "Pending":
            continue
        if ann.get(names.ANN_MEM_ASSIGNED) != "false" or names.ANN_MEM_ASSUME_TIME not in ann:
            continue
        candidates.append((int(ann[names.ANN_MEM_ASSUME_TIME]), pod))
    for _, pod in sorted(candidates, key=lambda item: item[0]):
        if int(pod["metadata"]["annotations"][names.ANN_MEM_POD]) == request:
            return pod
    return None


def test_bind_writes_annotations_the_original_device_plugin_matches(ext: Extender) -> None:
    first = ext.pending(gpu_pod("first", [container("main", 6)]))
    second = ext.pending(gpu_pod("second", [container("main", 6)]))
    third = ext.pending(gpu_pod("third", [container("main", 3)]))
    for pod in (first, second, third):
        assert ext.bind(pod, "mixed") == {"Error": ""}
    pods = [get_pod(ext.api, "default", name) for name in ("third", "second", "first")]
    # equal requests are served in bind order; different sizes each find their own pod
    assert original_plugin_pick(pods, "mixed", 6)["metadata"]["name"] == "first"
    assert original_plugin_pick(pods, "mixed", 3)["metadata"]["name"] == "third"
    cards = {card.minor: card for card in ext.backends["mixed"].cards()}
    per_card = sum(card.memory_mib // 1024 for card in cards.values()) // len(cards)
    for pod in pods:
        ann = pod["metadata"]["annotations"]
        allocation = parse_allocation(ann[names.ANN_ALLOCATION])
        card = cards[int(ann[names.ANN_MEM_IDX])]
        assert allocation["main"][0].uuid == card.uuid  # IDX is the /dev/nvidia minor of the chosen card
        assert ann[names.ANN_MEM_DEV] == str(per_card)
        assert pod["spec"]["nodeName"] == "mixed"
    times = [int(p["metadata"]["annotations"][names.ANN_MEM_ASSUME_TIME]) for p in reversed(pods)]
    assert times == sorted(times) and all(t > 10**18 for t in times)  # nanoseconds since the epoch


def test_multi_card_and_multi_container_pods_get_distinct_whole_shapes(ext: Extender) -> None:
    pod = gpu_pod(
        "trainer",
        [container("pair", 16, 2), container("solo", 0, 1)],
        init=[container("warmup", 2)],
    )
    pending = ext.pending(pod)
    assert ext.call("filter", {"Pod": pending, "NodeNames": ["mixed", "small"]})["NodeNames"] == ["mixed"]
    assert ext.bind(pending, "mixed")["Error"] == ""
    ann = ext.annotations("trainer")
    allocation = parse_allocation(ann[names.ANN_ALLOCATION])
    request = parse_pod_request(pending)
    validate_allocation(request, allocation)
    pair, solo = allocation["pair"], allocation["solo"]
    assert [s.units for s in pair] == [8, 8] and len({s.uuid for s in pair}) == 2
    assert not {s.uuid for s in pair} & {s.uuid for s in solo}
    capacity = {card.uuid: card.memory_mib // 1024 for card in ext.backends["mixed"].cards()}
    assert solo[0].units == capacity[solo[0].uuid]  # an exclusive card is taken whole
    # the original keys name the first card of the first app container (by minor) and what the pod
    # holds there: the init container runs before, so it adds nothing to the pair's 8
    minors = {card.uuid: card.minor for card in ext.backends["mixed"].cards()}
    assert ann[names.ANN_MEM_IDX] == str(minors[pair[0].uuid])
    assert ann[names.ANN_MEM_POD] == "8"
    per_card = sum(capacity.values()) // len(capacity)
    assert json.loads(ann[names.ANN_FRAMEWORK_ALLOCATION]) == {
        "0": {str(minors[s.uuid]): 8 for s in pair},
        "1": {str(minors[solo[0].uuid]): per_card},
    }


def test_unknown_policy_or_unknown_pod_come_back_in_error(ext: Extender) -> None:
    odd = ext.pending(gpu_pod("odd", [container("main", 2)], extra_annotations={names.ANN_POLICY: "random"}))
    reply = ext.bind(odd, "small")
    assert names.ANN_POLICY in reply["Error"] and "random" in reply["Error"]
    assert "nodeName" not in get_pod(ext.api, "default", "odd")["spec"]
    ghost = ext.call("bind", {"PodName": "ghost", "PodNamespace": "default", "PodUID": "0-0", "Node": "small"})
    assert "pod default/ghost" in ghost["Error"] and "not found" in ghost["Error"]


# --- pods placed by the original extender ------------------------------------------------------------------


def test_pods_annotated_by_the_original_extender_are_counted(ext: Extender) -> None:
    minor = [card.minor for card in ext.backends["mixed"].cards()]  # the original numbers cards by minor
    legacy = gpu_pod("legacy", [container("main", 75)], node="mixed", original_index=minor[1])
    framework = gpu_pod(
        "framework",
        [container("a", 10), container("b", 5)],
        node="mixed",
        original_index=minor[0],
        extra_annotations={
            names.ANN_FRAMEWORK_ALLOCATION: json.dumps({"0": {str(minor[0]): 10}, "1": {str(minor[2]): 5}})
        },
    )
    for pod in (legacy, framework):
        ext.core.create_namespaced_pod("default", pod)
    wait_counted(ext, "mixed", [10, 75, 5])
    pod = ext.pending(gpu_pod("p", [container("main", 71)]))
    reply = ext.call("filter", {"Pod": pod, "NodeNames": ["mixed"]})
    assert reply["FailedNodes"] == {"mixed": "no single card has 71 GiB free (largest free: 70 GiB on card 0)"}
    ext.core.delete_namespaced_pod("framework", "default", grace_period_seconds=0)
    wait_counted(ext, "mixed", [0, 75, 0])


def test_framework_allocation_round_trips_by_container_position_and_minor() -> None:
    pod = gpu_pod("p", [container("a", 10), container("b", 4, 2)], init=[container("i", 1)])
    request = parse_pod_request(pod)
    cards = [Card(i, f"GPU-{i}", "T4", 16384, minor=10 + i) for i in range(3)]
    text = format_framework_allocation({"a": {11: 10}, "b": {10: 2, 12: 2}}, request)
    assert json.loads(text) == {"0": {"11": 10}, "1": {"10": 2, "12": 2}}
    assert pod_allocation(
        {**pod, "metadata": {**pod["metadata"], "annotations": {names.ANN_FRAMEWORK_ALLOCATION: text}}}, cards
    ) == {
        "a": (CardSlice(1, "GPU-1", 10),),
        "b": (CardSlice(0, "GPU-0", 2), CardSlice(2, "GPU-2", 2)),
    }
    with pytest.raises(AnnotationError, match="can't name init or unknown containers"):
        format_framework_allocation({"i": {10: 1}}, request)

    def annotated(value: dict) -> dict:
        return {
            **pod,
            "metadata": {**pod["metadata"], "annotations": {names.ANN_FRAMEWORK_ALLOCATION: json.dumps(value)}},
        }

    with pytest.raises(AnnotationError, match="'2' is not an app container's position"):
        pod_allocation(annotated({"2": {"10": 1}}), cards)
    with pytest.raises(ContractError, match=r"card 7 \(a /dev/nvidia minor number\) is not on this node"):
        pod_allocation(annotated({"0": {"7": 1}}), cards)


# --- preempt --------------------------------------------------------------------------------------------


def test_preempt_with_full_victim_pods_answers_meta_victims(ext: Extender) -> None:
    big = ext.pending(gpu_pod("big", [container("main", 20)]))
    small = ext.pending(gpu_pod("small-one", [container("main", 4)]))
    for pod in (big, small):
        assert ext.bind(pod, "small")["Error"] == ""
    wait_counted(ext, "small", [24])
    victims = [get_pod(ext.api, "default", name) for name in ("small-one", "big")]
    preemptor = ext.pending(gpu_pod("urgent", [container("main", 18)]))
    reply = ext.call(
        "preempt",
        {"Pod": preemptor, "NodeNameToVictims": {"small": {"Pods": victims, "NumPDBViolations": 1}}},
    )
    assert reply == {
        "NodeNameToMetaVictims": {"small": {"Pods": [{"UID": big["metadata"]["uid"]}], "NumPDBViolations": 1}}
    }
    hopeless = ext.pending(gpu_pod("hopeless", [container("main", 30)]))
    reply = ext.call("preempt", {"Pod": hopeless, "NodeNameToVictims": {"small": {"Pods": victims}}})
    assert reply == {"NodeNameToMetaVictims": {}}


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verb", "data"),
    [
        ("filter", b'{"Pod": {'),
        ("filter", b"[1, 2]"),
        ("prioritize", b'{"Pod": {"metadata": {}}, "NodeNames": [1]}'),
        ("filter", b'{"Pod": {"metadata": {}}}'),
        ("bind", b'{"PodName": "p"}'),
        ("preempt", b'"just a string"'),
    ],
)
def test_malformed_requests_get_400_with_a_message_and_the_server_lives_on(
    ext: Extender, verb: str, data: bytes
) -> None:
    status, reply = ext.raw(verb, data)
    assert status == 400 and reply["Error"]
    assert ext.get("/healthz")[0] == 200
    pod = ext.pending(gpu_pod("after", [container("main", 1)]))
    assert ext.call("filter", {"Pod": pod, "NodeNames": ["small"]})["NodeNames"] == ["small"]


# --- moving from the original gpushare (see tests/core/test_migration.py) -------------------------------------------


def test_a_node_running_the_original_plugin_is_scheduled_from_its_status(ext: Extender) -> None:
    original_node(ext.core, "legacy", 32, 2)
    wait_until(lambda: ext.running.cache.view("legacy"), what="the legacy node in the extender's cache")
    # a pod the original extender placed there holds card 0
    ext.core.create_namespaced_pod("default", gpu_pod("old", [container("main", 12)], node="legacy", original_index=0))
    wait_until(lambda: ext.used("legacy") == [12, 0], what="the original pod counted on card 0")

    pod = ext.pending(gpu_pod("p", [container("main", 10)]))
    reply = ext.call("filter", {"Pod": pod, "NodeNames": ["legacy"]})
    assert reply["NodeNames"] == ["legacy"], reply
    assert ext.bind(pod, "legacy") == {"Error": ""}
    ann = ext.annotations("p")
    # only what the original device plugin reads: its card number, the node total / cards, no UUIDs
    assert names.ANN_ALLOCATION not in ann
    assert ann[names.ANN_MEM_DEV] == "16" and ann[names.ANN_MEM_POD] == "10" and ann[names.ANN_MEM_ASSIGNED] == "false"
    assert json.loads(ann[names.ANN_FRAMEWORK_ALLOCATION]) == {"0": {ann[names.ANN_MEM_IDX]: 10}}
    wait_until(lambda: sorted(ext.used("legacy")) == [10, 12], what="both pods counted")

    # what that plugin can't serve is refused there, with the reason
    pair = ext.pending(gpu_pod("pair", [container("main", 4, 2)]))
    reply = ext.call("filter", {"Pod": pair, "NodeNames": ["legacy", "mixed"]})
    assert reply["NodeNames"] == ["mixed"]
    assert "runs the original gpushare device plugin" in reply["FailedNodes"]["legacy"]
    assert "runs the original gpushare device plugin" in ext.bind(pair, "legacy")["Error"]


def test_the_original_url_prefix_answers_filter_bind_and_inspect(ext: Extender) -> None:
    pod = ext.pending(gpu_pod("p", [container("main", 20)]))
    status, reply = ext.raw("gpushare-scheduler/filter", json.dumps({"Pod": pod, "NodeNames": ["small"]}).encode())
    assert status == 200 and reply["NodeNames"] == ["small"]
    meta = pod["metadata"]
    args = {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "small"}
    status, reply = ext.raw("gpushare-scheduler/bind", json.dumps(args).encode())
    assert status == 200 and reply == {"Error": ""}
    wait_until(lambda: ext.used("small") == [20], what="the bound pod counted")

    status, body = ext.get("/gpushare-scheduler/inspect/small")
    assert status == 200
    assert json.loads(body) == {
        "nodes": [
            {
                "name": "small",
                "totalGPU": 24,
                "usedGPU": 20,
                "devs": [
                    {
                        "id": 0,
                        "totalGPU": 24,
                        "usedGPU": 20,
                        "pods": [{"name": "p", "namespace": "default", "usedGPU": 20}],
                    }
                ],
            }
        ]
    }
    status, body = ext.get("/gpushare-scheduler/inspect")
    assert status == 200 and {n["name"] for n in json.loads(body)["nodes"]} == {"mixed", "small"}
    status, body = ext.get("/gpushare-scheduler/inspect/ghost")
    assert status == 404 and "ghost" in json.loads(body)["error"]


def test_cards_listed_in_the_unhealthy_gpu_configmap_take_no_pods(ext: Extender) -> None:
    minors = {card.minor: card.index for card in ext.backends["mixed"].cards()}
    ext.core.create_namespaced_config_map(
        "kube-system",
        {"metadata": {"name": "unhealthy-gpu-mixed"}, "data": {"gpus": ",".join(str(m) for m in sorted(minors)[:2])}},
    )
    fenced = {minors[m] for m in sorted(minors)[:2]}
    open_card = ({0, 1, 2} - fenced).pop()
    wait_until(
        lambda: not any(card.healthy for card in ext.running.cache.view("mixed").cards if card.index in fenced),
        what="the fenced cards in the extender's view",
    )
    pod = ext.pending(gpu_pod("p", [container("main", 2)]))
    assert ext.bind(pod, "mixed") == {"Error": ""}
    assert [s.index for s in parse_allocation(ext.annotations("p")[names.ANN_ALLOCATION])["main"]] == [open_card]
    ext.core.delete_namespaced_config_map("unhealthy-gpu-mixed", "kube-system")
    wait_until(lambda: all(card.healthy for card in ext.running.cache.view("mixed").cards), what="the fence lifted")


def test_multi_card_and_whole_card_pods_are_counted_right_by_the_original_components(ext: Extender) -> None:
    pair = ext.pending(gpu_pod("pair", [container("main", 16, 2)]))
    assert ext.bind(pair, "mixed") == {"Error": ""}
    whole = ext.pending(gpu_pod("whole", [container("main", 0, 1)]))
    assert ext.bind(whole, "mixed") == {"Error": ""}
    cards = ext.backends["mixed"].cards()
    per_card = sum(card.memory_mib // 1024 for card in cards) // len(cards)  # 58, as the original computes
    pair_pod, whole_pod = (get_pod(ext.api, "default", name) for name in ("pair", "whole"))
    # the original inspect: 8 on each of the pair's two cards, not 16 on the first
    assert sorted(original_inspect_usage(pair_pod).values()) == [8, 8]
    # the whole card is full in the original's eyes, not free (_POD was 0 before)
    whole_ann = whole_pod["metadata"]["annotations"]
    assert whole_ann[names.ANN_MEM_POD] == whole_ann[names.ANN_MEM_DEV] == str(per_card)
    assert original_inspect_usage(whole_pod) == {int(whole_ann[names.ANN_MEM_IDX]): per_card}
    # the original extender counts _POD on the _IDX card: the pair holds 8 there
    pair_ann = pair_pod["metadata"]["annotations"]
    assert pair_ann[names.ANN_MEM_POD] == "8" and pair_ann[names.ANN_MEM_DEV] == str(per_card)


def test_an_init_container_runs_inside_the_app_containers_share(ext: Extender) -> None:
    filler = ext.pending(gpu_pod("filler", [container("main", 18)]))
    assert ext.bind(filler, "small") == {"Error": ""}
    pod = ext.pending(gpu_pod("p", [container("a", 4), container("b", 2)], init=[container("warmup", 2)]))
    reply = ext.call("filter", {"Pod": pod, "NodeNames": ["small"]})
    assert reply["NodeNames"] == ["small"], reply  # 6 of the card's 6 free, not 8
    assert ext.bind(pod, "small") == {"Error": ""}
    wait_until(lambda: ext.used("small") == [24], what="the card counted full, not over-committed")
    bound = get_pod(ext.api, "default", "p")
    allocation = pod_allocation(bound, ext.backends["small"].cards())
    assert sum(held_units(allocation, parse_pod_request(bound)).values()) == 6
    assert parse_pod_request(bound).effective_mem == 6


def _forge_and_damage(cluster: Cluster, damage: str | None) -> tuple[dict, str, str]:
    """l1 takes all 80 GiB of an A100 of n1, then claims the other in its annotation; n1's ledger is then damaged
    (``damage`` written over it, or removed when None). Returns l1, its card and the one it claims."""
    l1 = cluster.pod(gpu_pod("l1", [container("main", 80)], node=None))
    cards = [c for c in cluster.backends["n1"].cards() if c.model.startswith("A100")]
    assert cluster.bind(l1, "n1")["Error"] == ""
    (mine,) = cluster.allocation("l1")["main"]
    other = next(c for c in cards if c.uuid != mine.uuid)
    forged = format_allocation({"main": (CardSlice(other.index, other.uuid, 80),)})
    cluster.core.patch_namespaced_pod("l1", "default", {"metadata": {"annotations": {names.ANN_ALLOCATION: forged}}})
    wait_until(lambda: cluster.extender.cache.ledger("n1"), what="the ledger in the cache")
    cluster.core.patch_node("n1", {"metadata": {"annotations": {names.NODE_ANN_PENDING_BINDS: damage}}})
    return l1, mine.uuid, other.uuid


@pytest.mark.parametrize("damage", ["{not json", None])
def test_a_damaged_ledger_is_rebuilt_from_the_last_one_read_and_a_forgery_gains_nothing(
    cluster: Cluster, damage: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    l1, held, claimed = _forge_and_damage(cluster, damage)
    wait_until(
        lambda: any(
            r.levelname == "ERROR" and f"node n1 annotation {names.NODE_ANN_PENDING_BINDS}" in r.getMessage()
            for r in caplog.records
        ),
        what="the damage logged",
    )
    l2 = cluster.pod(gpu_pod("l2", [container("main", 80)], node=None))
    assert cluster.bind(l2, "n1")["Error"] == ""
    (card,) = cluster.allocation("l2")["main"]
    assert card.uuid == claimed != held, "l2 must not share the card l1 really holds"
    ledger = parse_pending_binds(cluster.core.read_node("n1").metadata.annotations[names.NODE_ANN_PENDING_BINDS])
    assert dict(ledger[l1["metadata"]["uid"]].held) == {held: 80}, "the ledger is repaired with l1's true card"


@pytest.mark.parametrize("damage", ["{not json", None])
def test_without_a_ledger_read_before_the_damage_binds_onto_the_node_are_refused(
    cluster: Cluster, damage: str | None
) -> None:
    _forge_and_damage(cluster, damage)
    fresh = start_extender(cluster.api, 0, "binpack", host="127.0.0.1")  # started after the damage
    try:
        assert fresh.cache.wait_synced(5)
        other = Cluster.beside(cluster, fresh)
        wait_until(lambda: fresh.cache.problem("n1"), what="the damage in the new replica's cache")
        l2 = cluster.pod(gpu_pod("l2", [container("main", 80)], node=None))
        error = other.bind(l2, "n1")["Error"]
        assert f"node n1 annotation {names.NODE_ANN_PENDING_BINDS}" in error and "refused until it is repaired" in error
        assert cluster.core.read_namespaced_pod("l2", "default").spec.node_name is None
        reasons = other.filter(l2)["FailedAndUnresolvableNodes"]
        assert "takes no GPU pods until its ledger is repaired" in reasons["n1"]
    finally:
        fresh.stop()
