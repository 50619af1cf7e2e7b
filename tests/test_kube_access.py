"""Kubernetes access helpers: typed errors, preconditions, the node-scoped watch cache."""

from __future__ import annotations

import pytest
from conftest import wait_until
from kubernetes import client

from gpushare.kube import errors, objects, retry, transport, watch
from gpushare.sandbox.apiserver import ApiServer


def pod(name: str, node: str) -> dict:
    return {"metadata": {"name": name}, "spec": {"nodeName": node, "containers": [{"name": "c", "image": "b"}]}}


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
