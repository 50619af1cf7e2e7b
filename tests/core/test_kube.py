"""Kubernetes access: retries through outages, preconditions, typed errors, the Event recorder (order,
deduplication, never blocking) and the watch cache's recovery paths (410 Gone, re-listing), against the
API server stand-in.

Kubernetes access helpers: typed errors, preconditions, the node-scoped watch cache."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.config import kube_config
from podfactory import container, gpu_pod
from support.waiting import wait_until

from gpushare.contract.names import ANN_ALLOCATION
from gpushare.kube import errors, events, objects, retry, transport, watch
from gpushare.sandbox import apiserver as standin
from gpushare.sandbox import store
from gpushare.sandbox.apiserver import ApiServer

FAST = retry.Backoff(initial=0.02, maximum=0.1)


def pod(name: str, node: str | None = None, labels: dict[str, str] | None = None) -> dict:
    return gpu_pod(name, [container("c")], node=node, namespace=None, labels=labels or {})


@pytest.fixture
def node_cache(kube_api: client.ApiClient) -> Iterator[watch.WatchCache]:
    cache = watch.WatchCache(kube_api, "nodes", label_selector="gpu=yes", backoff=FAST)
    yield cache
    cache.stop()


def test_patch_rides_out_an_outage(
    apiserver: ApiServer, kube_api: client.ApiClient, core_v1: client.CoreV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    core_v1.create_namespaced_pod("default", pod("a"))
    caplog.set_level(logging.WARNING, logger="gpushare.kube")
    apiserver.pause()
    result: list[dict] = []
    writer = threading.Thread(
        target=lambda: result.append(
            objects.patch_pod_annotations(kube_api, "default", "a", {"k": "v"}, retries=200, backoff=FAST)
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
        with pytest.raises(errors.KubeUnavailable, match="pod default/a: API server unreachable"):
            objects.patch_pod(kube_api, "default", "a", {"metadata": {"labels": {"x": "y"}}}, retries=1, backoff=FAST)
    finally:
        apiserver.resume()


def test_patch_pod_removes_annotations_given_none(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", pod("a"))
    objects.patch_pod_annotations(kube_api, "default", "a", {"keep": "1", "drop": "2"})
    patched = objects.patch_pod_annotations(kube_api, "default", "a", {"drop": None})
    assert patched["metadata"]["annotations"] == {"keep": "1"}


def test_node_patch_with_a_precondition(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    created = core_v1.create_node({"metadata": {"name": "n1"}}).metadata.resource_version

    def annotate(seq: str, version: str) -> dict:
        return objects.patch_node(kube_api, "n1", {"metadata": {"annotations": {"seq": seq}}}, resource_version=version)

    first = annotate("1", created)
    with pytest.raises(errors.KubeConflict, match="node n1"):
        annotate("2", created)
    assert objects.get_node(kube_api, "n1")["metadata"]["annotations"] == {"seq": "1"}
    annotate("2", first["metadata"]["resourceVersion"])
    assert objects.get_node(kube_api, "n1")["metadata"]["annotations"] == {"seq": "2"}


def test_bind_pod_errors_are_typed(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    uid = core_v1.create_namespaced_pod("default", pod("a")).metadata.uid
    objects.bind_pod(kube_api, "default", "a", uid, "n1")
    assert objects.get_pod(kube_api, "default", "a")["spec"]["nodeName"] == "n1"
    with pytest.raises(errors.KubeConflict, match="pod default/a to node n2"):
        objects.bind_pod(kube_api, "default", "a", uid, "n2")
    with pytest.raises(errors.KubeNotFound, match="pod default/ghost"):
        objects.bind_pod(kube_api, "default", "ghost", None, "n1")


def test_binding_sets_its_annotations_on_the_pod_in_the_same_write(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    uid = core_v1.create_namespaced_pod("default", pod("a")).metadata.uid
    objects.bind_pod(kube_api, "default", "a", uid, "n1", {ANN_ALLOCATION: "x"})
    bound = objects.get_pod(kube_api, "default", "a")
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"][ANN_ALLOCATION] == "x"


def test_list_pods_by_label(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", pod("a", labels={"gpu": "yes"}))
    core_v1.create_namespaced_pod("other", pod("b"))
    assert [p["metadata"]["name"] for p in objects.list_pods(kube_api, label_selector="gpu=yes")] == ["a"]
    assert sorted(p["metadata"]["name"] for p in objects.list_pods(kube_api)) == ["a", "b"]


def recorded_events(core_v1: client.CoreV1Api) -> list[client.CoreV1Event]:
    """The default namespace's Events, oldest first."""
    return sorted(core_v1.list_namespaced_event("default").items, key=lambda e: int(e.metadata.resource_version))


def test_events_record_the_object_in_order_by_close(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    target = objects.get_pod(kube_api, "default", core_v1.create_namespaced_pod("default", pod("a")).metadata.name)
    recorder = events.EventRecorder(kube_api, "gpushare")
    for i in range(3):
        recorder.record(target, reason="Assigned", message=f"card {i}", type_="Warning")
    recorder.close()
    recorded = recorded_events(core_v1)
    assert [(e.message, e.count) for e in recorded] == [("card 0", 1), ("card 1", 1), ("card 2", 1)]
    assert {(e.reason, e.type, e.source.component) for e in recorded} == {("Assigned", "Warning", "gpushare")}
    assert {(e.involved_object.name, e.involved_object.uid) for e in recorded} == {("a", target["metadata"]["uid"])}


def test_identical_events_are_one_event_with_a_count(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    a = objects.get_pod(kube_api, "default", core_v1.create_namespaced_pod("default", pod("a")).metadata.name)
    b = objects.get_pod(kube_api, "default", core_v1.create_namespaced_pod("default", pod("b")).metadata.name)
    recorder = events.EventRecorder(kube_api, "gpushare")
    for target, message in [(a, "m"), (a, "m"), (b, "m"), (a, "other"), (a, "m")]:
        recorder.record(target, reason="Refused", message=message, type_="Warning")
    recorder.close()
    assert [(e.involved_object.name, e.message, e.count) for e in recorded_events(core_v1)] == [
        ("b", "m", 1),
        ("a", "other", 1),
        ("a", "m", 3),  # patched last
    ]


def test_an_event_deleted_on_the_server_is_created_afresh(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    target = {"metadata": {"name": "a", "namespace": "default", "uid": "u1"}}
    recorder = events.EventRecorder(kube_api, "gpushare")
    recorder.record(target, reason="R", message="m")
    (first,) = wait_until(lambda: core_v1.list_namespaced_event("default").items, what="the first Event")
    core_v1.delete_namespaced_event(first.metadata.name, "default")  # as the API server does after its TTL
    recorder.record(target, reason="R", message="m")
    recorder.record(target, reason="R", message="m")
    recorder.close()
    (again,) = core_v1.list_namespaced_event("default").items
    assert again.metadata.name != first.metadata.name and again.count == 2


def test_components_sharing_a_recorder_each_name_themselves_as_the_source(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    target = {"metadata": {"name": "a", "namespace": "default", "uid": "u1"}}
    recorder = events.EventRecorder(kube_api, "gpushare-node")
    plugin, shim = recorder.for_component("gpushare-device-plugin"), recorder.for_component("gpushare-cri-shim")
    for source in (plugin, shim, plugin):
        source.record(target, reason="R", message="m", type_="Warning")
    recorder.close()
    # the same message from two components is two Events; from one, one Event counted twice
    assert sorted((e.source.component, e.count) for e in recorded_events(core_v1)) == [
        ("gpushare-cri-shim", 1),
        ("gpushare-device-plugin", 2),
    ]


def test_a_recorder_started_again_writes_what_was_queued_and_what_comes(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    recorder = events.EventRecorder(kube_api, "gpushare")
    target = {"metadata": {"name": "a", "namespace": "default"}}
    recorder.record(target, reason="R", message="before")
    recorder.close()
    assert not recorder.alive()
    recorder.start()
    recorder.record(target, reason="R", message="after")
    recorder.close()
    assert [e.message for e in recorded_events(core_v1)] == ["before", "after"]


def test_recording_never_waits_for_a_stalled_api_server(
    kube_api: client.ApiClient,
    core_v1: client.CoreV1Api,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the API server sits on the first Event, the caller goes on; past the queue's bound an Event
    is dropped with a log line rather than held."""
    stalled, release = threading.Event(), threading.Event()
    original = standin._Handler._send

    def slow(self: standin._Handler, code: int, body: object) -> None:
        if "/events" in self.path and not stalled.is_set():
            stalled.set()
            release.wait(10)
        original(self, code, body)

    monkeypatch.setattr(standin._Handler, "_send", slow)
    caplog.set_level(logging.WARNING, logger="gpushare.kube")
    recorder = events.EventRecorder(kube_api, "gpushare", queue_size=1)
    target = {"metadata": {"name": "a", "namespace": "default"}}
    recorder.record(target, reason="R", message="written while the server stalls")
    assert stalled.wait(5)
    recorder.record(target, reason="R", message="queued")
    recorder.record(target, reason="R", message="dropped")
    assert "event R on default/a dropped: too many events queued" in caplog.messages
    release.set()
    recorder.close()
    assert [e.message for e in recorded_events(core_v1)] == ["written while the server stalls", "queued"]


def test_an_outage_costs_the_event_and_nothing_else(
    apiserver: ApiServer, kube_api: client.ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpushare.kube")
    recorder = events.EventRecorder(kube_api, "gpushare")
    apiserver.pause()
    try:
        recorder.record({"metadata": {"name": "p", "namespace": "default"}}, reason="R", message="m")
        recorder.close()
    finally:
        apiserver.resume()
    assert any(m.startswith("could not record event R on default/p: ") for m in caplog.messages)


def test_the_event_log_is_bounded_and_forgets_after_its_window() -> None:
    log = events.EventLog(capacity=2, window=60.0)
    keys = [events.EventKey("c", "Pod", "default", name, "", "Normal", "R", "m") for name in "abc"]
    log.remember(keys[0], events.Written("a.1", 1, at=0.0))
    log.remember(keys[1], events.Written("b.1", 1, at=0.0))
    assert log.lookup(keys[0], now=1.0) is not None  # a is now the most recently used
    log.remember(keys[2], events.Written("c.1", 1, at=1.0))
    assert len(log) == 2 and log.lookup(keys[1], now=1.0) is None  # b was the least recently used
    assert log.lookup(keys[0], now=60.0) == events.Written("a.1", 1, at=0.0)
    assert log.lookup(keys[0], now=60.1) is None and len(log) == 1  # written more than a window ago


def test_node_cache_follows_label_scope_and_modifications(
    node_cache: watch.WatchCache, core_v1: client.CoreV1Api
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
    node_cache: watch.WatchCache,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(store, "HISTORY", 2)
    monkeypatch.setattr(apiserver, "store", store.Store())
    core_v1.create_node({"metadata": {"name": "n0", "labels": {"gpu": "yes"}}})
    caplog.set_level(logging.INFO, logger="gpushare.kube")

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
    with pytest.raises(errors.KubeConfigError, match="no in-cluster configuration"):
        transport.load_api(None)


def test_load_api_from_a_kubeconfig_reaches_the_server(apiserver: ApiServer, kubeconfig: Path) -> None:
    api = transport.load_api(str(kubeconfig))
    assert api.configuration.host == apiserver.url
    assert objects.list_pods(api) == []


def test_node_cache_follows_only_its_node(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", pod("before", "n1"))
    cache = watch.node_pod_cache(kube_api, "n1")
    seen: list[tuple[str, str]] = []
    cache.add_listener(lambda kind, obj: seen.append((kind, obj["metadata"]["name"])))
    cache.start()
    try:
        assert cache.wait_synced(5) and cache.connected
        core_v1.create_namespaced_pod("default", pod("mine", "n1"))
        core_v1.create_namespaced_pod("default", pod("theirs", "n2"))
        core_v1.delete_namespaced_pod("before", "default", grace_period_seconds=0)  # as kubelet finishes it
        wait_until(lambda: ("DELETED", "before") in seen, what="the delete event")
        assert sorted(p["metadata"]["name"] for p in cache.items()) == ["mine"]
        assert cache.get("theirs", "default") is None
    finally:
        cache.stop()


def test_cache_catches_up_after_an_outage(
    apiserver: ApiServer, kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    cache = watch.node_pod_cache(kube_api, "n1")
    cache.start()
    try:
        assert cache.wait_synced(5)
        core_v1.create_namespaced_pod("default", pod("a", "n1"))
        wait_until(lambda: cache.get("a", "default"))
        apiserver.pause()
        wait_until(lambda: not cache.connected, 10, "the cache to notice the outage")
        apiserver.resume()
        core_v1.delete_namespaced_pod(
            "a", "default", grace_period_seconds=0
        )  # happens while the cache may still be reconnecting
        wait_until(lambda: cache.connected and cache.get("a", "default") is None, 10, "the cache to catch up")
    finally:
        cache.stop()


def test_own_writes_are_visible_at_once(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", pod("a", "n1"))
    cache = watch.node_pod_cache(kube_api, "n1")
    cache.start()
    try:
        assert cache.wait_synced(5)
        updated = objects.patch_pod_annotations(kube_api, "default", "a", {"k": "v"})
        cache.apply(updated)
        assert cache.get("a", "default")["metadata"]["annotations"] == {"k": "v"}
    finally:
        cache.stop()


def test_precondition_conflict_is_not_retried(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> None:
    created = core_v1.create_namespaced_pod("default", pod("a", "n1"))
    objects.patch_pod_annotations(kube_api, "default", "a", {"k": "1"})
    with pytest.raises(errors.KubeConflict, match="pod default/a"):
        objects.patch_pod(
            kube_api,
            "default",
            "a",
            {"metadata": {"labels": {"x": "y"}}},
            resource_version=created.metadata.resource_version,
        )


def test_typed_errors_name_the_object(apiserver: ApiServer, kube_api: client.ApiClient) -> None:
    with pytest.raises(errors.KubeNotFound, match="pod default/ghost"):
        objects.get_pod(kube_api, "default", "ghost")
    apiserver.pause()
    try:
        with pytest.raises(errors.KubeUnavailable, match="node n1: API server unreachable"):
            objects.get_node(kube_api, "n1")
    finally:
        apiserver.resume()


def test_missing_kubeconfig_is_one_clear_error(tmp_path) -> None:
    with pytest.raises(errors.KubeConfigError, match=r"kubeconfig .*nope"):
        transport.load_api(str(tmp_path / "nope"))


def test_backoff_grows_to_its_cap() -> None:
    delays = retry.Backoff(initial=0.1, maximum=1.0, factor=2.0, jitter=0.0).delays()
    assert [round(next(delays), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


class Slammer:
    """A loopback port that accepts each connection and closes it at once, counting them: an API
    server that is down behind its load balancer."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.connections = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._sock.close()
        self._thread.join(timeout=5)


def test_an_unreachable_api_server_is_one_line_of_ours_and_no_urllib3_retry_warnings(
    apiserver: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    down = Slammer()
    config = apiserver.kubeconfig()
    config["clusters"][0]["cluster"]["server"] = down.url
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    api = transport.load_api(str(path))
    fast = retry.Backoff(initial=0.01, maximum=0.05)
    caches = [watch.WatchCache(api, "pods", backoff=fast), watch.WatchCache(api, "nodes", backoff=fast)]
    with caplog.at_level(logging.INFO):
        for cache in caches:
            cache.start()
        try:
            wait_until(lambda: down.connections >= 20, 20, "the caches to try the API server again and again")
        finally:
            for cache in caches:
                cache.stop()
            down.close()
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")]
    ours = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(ours) == 1 and ours[0].startswith(f"API server {down.url} unreachable ("), ours


def test_a_rate_limit_says_yes_once_per_period_per_key() -> None:
    limit = transport.RateLimit(30.0)
    assert limit.allow("a", 100.0) and limit.allow("b", 100.0)
    assert not limit.allow("a", 129.9)
    assert limit.allow("a", 130.0) and not limit.allow("a", 131.0)
