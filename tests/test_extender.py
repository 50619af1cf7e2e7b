"""The scheduler extender over HTTP, with request bodies shaped exactly as kube-scheduler sends them."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import readiness, wait_until
from kubernetes import client
from podfactory import container, gpu_pod

from advertiser.agent import Advertiser
from extender.engine import PlacementEngine
from extender.wiring import RunningExtender, start_extender
from gpushare.contract.allocation import parse_allocation
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_DEV,
    ANN_MEM_IDX,
    ANN_MEM_POD,
    NODE_ANN_PENDING_BINDS,
)
from gpushare.contract.pending import PendingBind, format_pending_binds, parse_pending_binds
from gpushare.contract.units import GIB
from gpushare.inventory import SimulatedBackend
from gpushare.usage import node_usage

NODES = {"n1": "2xA100-80GB:81920,1xT4:15360", "n2": "1xA10:24576"}


class Cluster:
    def __init__(self, api: client.ApiClient, core: client.CoreV1Api, policy: str = "binpack") -> None:
        self.api, self.core = api, core
        self.backends = {}
        for name, spec in NODES.items():
            core.create_node({"metadata": {"name": name}})
            self.backends[name] = SimulatedBackend(name, spec)
            Advertiser(api, name, self.backends[name], GIB).publish_once()
        self.extender: RunningExtender = start_extender(api, 0, policy, host="127.0.0.1")
        assert self.extender.cache.wait_synced(5)
        wait_until(lambda: all(self.extender.cache.view(n) for n in NODES), what="the inventories in the cache")
        self.url = f"http://127.0.0.1:{self.extender.server.port}"

    def post(self, verb: str, body: Any, raw: bytes | None = None) -> Any:
        data = raw if raw is not None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/{verb}", data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(reply.read())

    def pod(self, pod: dict) -> dict:
        """Create ``pod`` unbound and return it as the scheduler would send it (a full v1.Pod)."""
        pod = {**pod, "spec": {k: v for k, v in pod["spec"].items() if k != "nodeName"}}
        created = self.core.create_namespaced_pod("default", pod)
        return self.api.sanitize_for_serialization(created)

    def filter(self, pod: dict, names=tuple(NODES)) -> dict:
        return self.post("filter", {"Pod": pod, "NodeNames": list(names)})

    def bind(self, pod: dict, node: str) -> dict:
        meta = pod["metadata"]
        return self.post(
            "bind", {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": node}
        )

    def allocation(self, name: str) -> dict:
        ann = self.core.read_namespaced_pod(name, "default").metadata.annotations or {}
        return parse_allocation(ann[ANN_ALLOCATION]) if ANN_ALLOCATION in ann else {}


@pytest.fixture
def cluster(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> Iterator[Cluster]:
    cl = Cluster(kube_api, core_v1)
    yield cl
    cl.extender.stop()


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
    assert all(0 <= s["Score"] <= 10 for s in scores)
    by_host = {s["Host"]: s["Score"] for s in scores}
    assert by_host["n2"] > by_host["n1"]


def test_bind_writes_all_annotations_compatible_with_the_original_plugin(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("p", [container("a", 6), container("b", 2)]))
    assert cluster.bind(pod, "n1")["Error"] == ""
    got = cluster.core.read_namespaced_pod("p", "default")
    ann = got.metadata.annotations
    assert got.spec.node_name == "n1"
    assert ann[ANN_MEM_ASSIGNED] == "false"
    assert int(ann[ANN_MEM_ASSUME_TIME]) > 1_600_000_000 * 10**9  # nanoseconds
    assert ann[ANN_MEM_POD] == "8"  # the pod's total, as the original plugin matches on
    alloc = parse_allocation(ann[ANN_ALLOCATION])
    assert set(alloc) == {"a", "b"}
    first = alloc["a"][0]
    cards = {card.uuid: card for card in cluster.backends["n1"].cards()}
    assert ann[ANN_MEM_IDX] == str(cards[first.uuid].minor)  # the original components number cards by minor
    # what the original extender takes each card to hold: the node's total over its cards
    assert ann[ANN_MEM_DEV] == str(sum(card.memory_mib // 1024 for card in cards.values()) // len(cards))


def test_a_bind_records_which_cards_the_pod_got_in_an_event(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("p", [container("main", 6)]))
    assert cluster.bind(pod, "n2")["Error"] == ""

    def events() -> list[tuple[str, str]]:
        listed = cluster.core.list_namespaced_event("default").items
        return [(e.reason, e.message) for e in listed if e.involved_object.uid == pod["metadata"]["uid"]]

    wait_until(events, what="the pod's event")
    assert events() == [("GPUAssigned", "node n2: main: card 0 (6)")]


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


def test_a_bind_another_replica_recorded_on_the_node_counts_until_its_pod_is_gone(cluster: Cluster) -> None:
    # another replica has bumped node n2 for its pod "other" (20 of the A10's 24 GiB) and not yet bound it
    other = cluster.pod(gpu_pod("other", [container("main", 20)]))
    a10 = cluster.backends["n2"].cards()[0].uuid
    pending = {other["metadata"]["uid"]: PendingBind("default/other", {a10: 20}, time.time())}
    cluster.core.patch_node(
        "n2", {"metadata": {"annotations": {NODE_ANN_PENDING_BINDS: format_pending_binds(pending)}}}
    )
    pod = cluster.pod(gpu_pod("p", [container("main", 8)]))
    assert "no single card has 8 GiB free" in cluster.bind(pod, "n2")["Error"]
    cluster.core.delete_namespaced_pod("other", "default")
    assert cluster.bind(pod, "n2")["Error"] == ""
    recorded = parse_pending_binds(cluster.core.read_node("n2").metadata.annotations[NODE_ANN_PENDING_BINDS])
    assert list(recorded) == [pod["metadata"]["uid"]] and recorded[pod["metadata"]["uid"]].held == {a10: 8}


def test_failed_binding_takes_the_assignment_back(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    cluster.core.create_namespaced_pod_binding(
        "p",
        "default",
        client.V1Binding(metadata=client.V1ObjectMeta(name="p"), target=client.V1ObjectReference(name="n2")),
        _preload_content=False,
    )
    reply = cluster.bind(pod, "n1")
    assert "creating the binding failed" in reply["Error"]
    assert ANN_ALLOCATION not in (cluster.core.read_namespaced_pod("p", "default").metadata.annotations or {})
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
        assert b"gpushare_extender_verb_seconds" in reply.read()


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
