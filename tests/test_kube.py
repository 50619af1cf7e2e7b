"""Kubernetes access: retries through outages, preconditions, typed errors, and the watch cache's
recovery paths (410 Gone, re-listing), against the API server stand-in."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until
from kubernetes import client
from kubernetes.config import kube_config

from gpushare import contract as c
from gpushare import kube
from gpushare.sandbox import store
from gpushare.sandbox.apiserver import ApiServer

FAST = kube.Backoff(initial=0.02, maximum=0.1)


def pod(name: str, node: str | None = None, labels: dict[str, str] | None = None) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "b"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


@pytest.fixture
def node_cache(kube_api: client.ApiClient) -> Iterator[kube.WatchCache]:
    cache = kube.WatchCache(kube_api, "nodes", label_selector="gpu=yes", backoff=FAST)
    yield cache
    cache.stop()


def test_patch_rides_out_an_outage(
    apiserver: ApiServer, kube_api: client.ApiClient, core_v1: client.CoreV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    core_v1.create_namespaced_pod("default", pod("a"))
    caplog.set_level(logging.WARNING, logger=kube.__name__)
    apiserver.pause()
    result: list[dict] = []
    writer = threading.Thread(
        target=lambda: result.append(
            kube.patch_pod_annotations(kube_api, "default", "a", {"k": "v"}, retries=200, backoff=FAST)
        )
    )
    writer.start()
    try:
        wait_until(lambda: any("pod default/a" in r.getMessage() for r in caplog.records), what="a retry log line")
    finally:
        apiserver.resume()
    writer.join(10)
    assert result and result[0]["metadata"]["annotations"] == {"k": "v"}
    assert core_v1.read_namespaced_pod("a", "default").metadata.annotations == {"k": "v"}


def test_patch_gives_up_with_kube_unavailable(apiserver: ApiServer, kube_api: client.ApiClient) -> None:
    apiserver.pause()
    try:
        with pytest.raises(kube.KubeUnavailable, match="pod default/a: API server unreachable"):
            kube.patch_pod(kube_api, "default", "a", {"metadata": {"labels": {"x": "y"}}}, retries=1, backoff=FAST)
    finally:
        apiserver.resume()


def test_patch_pod_removes_annotations_given_none(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", pod("a"))
    kube.patch_pod_annotations(kube_api, "default", "a", {"keep": "1", "drop": "2"})
    patched = kube.patch_pod_annotations(kube_api, "default", "a", {"drop": None})
    assert patched["metadata"]["annotations"] == {"keep": "1"}


def test_node_patch_with_a_precondition(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    created = core_v1.create_node({"metadata": {"name": "n1"}}).metadata.resource_version

    def annotate(seq: str, version: str) -> dict:
        return kube.patch_node(kube_api, "n1", {"metadata": {"annotations": {"seq": seq}}}, resource_version=version)

    first = annotate("1", created)
    with pytest.raises(kube.KubeConflict, match="node n1"):
        annotate("2", created)
    assert kube.get_node(kube_api, "n1")["metadata"]["annotations"] == {"seq": "1"}
    annotate("2", first["metadata"]["resourceVersion"])
    assert kube.get_node(kube_api, "n1")["metadata"]["annotations"] == {"seq": "2"}


def test_bind_pod_errors_are_typed(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    uid = core_v1.create_namespaced_pod("default", pod("a")).metadata.uid
    kube.bind_pod(kube_api, "default", "a", uid, "n1")
    assert kube.get_pod(kube_api, "default", "a")["spec"]["nodeName"] == "n1"
    with pytest.raises(kube.KubeConflict, match="pod default/a to node n2"):
        kube.bind_pod(kube_api, "default", "a", uid, "n2")
    with pytest.raises(kube.KubeNotFound, match="pod default/ghost"):
        kube.bind_pod(kube_api, "default", "ghost", None, "n1")


def test_binding_sets_its_annotations_on_the_pod_in_the_same_write(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    uid = core_v1.create_namespaced_pod("default", pod("a")).metadata.uid
    kube.bind_pod(kube_api, "default", "a", uid, "n1", {c.ANN_ALLOCATION: "x"})
    bound = kube.get_pod(kube_api, "default", "a")
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"][c.ANN_ALLOCATION] == "x"


def test_list_pods_by_label(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", pod("a", labels={"gpu": "yes"}))
    core_v1.create_namespaced_pod("other", pod("b"))
    assert [p["metadata"]["name"] for p in kube.list_pods(kube_api, label_selector="gpu=yes")] == ["a"]
    assert sorted(p["metadata"]["name"] for p in kube.list_pods(kube_api)) == ["a", "b"]


def test_create_event_records_the_object(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    target = kube.get_pod(kube_api, "default", core_v1.create_namespaced_pod("default", pod("a")).metadata.name)
    kube.create_event(kube_api, target, reason="Assigned", message="card 0", type_="Warning", component="gpushare")
    (event,) = core_v1.list_namespaced_event("default").items
    assert (event.reason, event.message, event.type, event.source.component) == (
        "Assigned",
        "card 0",
        "Warning",
        "gpushare",
    )
    assert (event.involved_object.name, event.involved_object.uid) == ("a", target["metadata"]["uid"])


def test_background_events_are_all_recorded_in_order_by_close(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    target = kube.get_pod(kube_api, "default", core_v1.create_namespaced_pod("default", pod("a")).metadata.name)
    events = kube.BackgroundEvents(kube_api, "gpushare")
    for i in range(3):
        events.record(target, reason="Assigned", message=f"card {i}")
    events.close()
    recorded = sorted(core_v1.list_namespaced_event("default").items, key=lambda e: int(e.metadata.resource_version))
    assert [e.message for e in recorded] == ["card 0", "card 1", "card 2"]
    assert {(e.reason, e.source.component, e.involved_object.name) for e in recorded} == {("Assigned", "gpushare", "a")}


def test_node_cache_follows_label_scope_and_modifications(
    node_cache: kube.WatchCache, core_v1: client.CoreV1Api
) -> None:
    core_v1.create_node({"metadata": {"name": "gpu1", "labels": {"gpu": "yes"}}})
    core_v1.create_node({"metadata": {"name": "cpu1"}})
    seen: list[tuple[str, str]] = []
    node_cache.add_listener(lambda kind, obj: seen.append((kind, obj["metadata"]["name"])))
    node_cache.start()
    assert node_cache.wait_synced(5) and node_cache.connected
    assert [n["metadata"]["name"] for n in node_cache.items()] == ["gpu1"]
    core_v1.patch_node("gpu1", {"metadata": {"annotations": {"cards": "2"}}})
    core_v1.patch_node("cpu1", {"metadata": {"labels": {"gpu": "yes"}}})  # enters the scope
    core_v1.patch_node("gpu1", {"metadata": {"labels": {"gpu": None}}})  # leaves it
    wait_until(lambda: ("DELETED", "gpu1") in seen, what="gpu1 to leave the cache")
    assert seen == [("ADDED", "gpu1"), ("MODIFIED", "gpu1"), ("ADDED", "cpu1"), ("DELETED", "gpu1")]
    assert [n["metadata"]["name"] for n in node_cache.items()] == ["cpu1"]
    assert node_cache.get("gpu1") is None


def test_cache_lists_again_when_its_watch_expires(
    apiserver: ApiServer,
    kube_api: client.ApiClient,
    core_v1: client.CoreV1Api,
    node_cache: kube.WatchCache,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(store, "HISTORY", 2)
    monkeypatch.setattr(apiserver, "store", store.Store())
    core_v1.create_node({"metadata": {"name": "n0", "labels": {"gpu": "yes"}}})
    caplog.set_level(logging.INFO, logger=kube.__name__)

    def outpace_history(kind: str, obj: dict) -> None:
        # Runs between the cache's LIST and its WATCH: three writes push the listed version out of the
        # two-event history, so the watch gets 410 Gone and the cache has to list again.
        if obj["metadata"]["name"] == "n0" and kind == "ADDED":
            for i in (1, 2, 3):
                core_v1.create_node({"metadata": {"name": f"n{i}", "labels": {"gpu": "yes"}}})

    node_cache.add_listener(outpace_history)
    node_cache.start()
    wait_until(lambda: len(node_cache.items()) == 4, what="the cache to list again after 410")
    assert any("expired" in r.getMessage() for r in caplog.records)


def test_load_api_without_any_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "absent"))
    with pytest.raises(kube.KubeConfigError, match="no in-cluster configuration"):
        kube.load_api(None)


def test_load_api_from_a_kubeconfig_reaches_the_server(apiserver: ApiServer, kubeconfig: Path) -> None:
    api = kube.load_api(str(kubeconfig))
    assert api.configuration.host == apiserver.url
    assert kube.list_pods(api) == []
