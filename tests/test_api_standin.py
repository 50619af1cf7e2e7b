"""The API server stand-in, driven through the official client exactly as the components drive a
real API server."""

from __future__ import annotations

import json
import threading

import pytest
from conftest import wait_until
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from gpushare.sandbox.apiserver import ApiServer


def make_pod(name: str, node: str | None = None, labels: dict[str, str] | None = None) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "busybox"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def status_of(err: ApiException) -> dict:
    return json.loads(err.body)


def test_create_get_list_with_field_and_label_selectors(core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a", "n1", {"app": "x", "tier": "web"}))
    core_v1.create_namespaced_pod("default", make_pod("b", "n2", {"app": "y"}))
    core_v1.create_namespaced_pod("other", make_pod("c", "n1"))
    got = core_v1.read_namespaced_pod("a", "default")
    assert got.status.phase == "Pending" and got.metadata.uid and int(got.metadata.resource_version) > 0

    def names(**kw) -> list[str]:
        return sorted(p.metadata.name for p in core_v1.list_pod_for_all_namespaces(**kw).items)

    assert names(field_selector="spec.nodeName=n1") == ["a", "c"]
    assert names(field_selector="spec.nodeName!=n1") == ["b"]
    assert names(field_selector="spec.nodeName=n1,metadata.namespace=default") == ["a"]
    assert names(field_selector="status.phase=Running") == []
    assert names(label_selector="app=x") == ["a"]
    assert names(label_selector="app in (x,y),tier") == ["a"]
    assert names(label_selector="!tier,app") == ["b"]
    assert [p.metadata.name for p in core_v1.list_namespaced_pod("other").items] == ["c"]
    with pytest.raises(ApiException) as err:
        core_v1.list_pod_for_all_namespaces(field_selector="spec.bogus=1")
    assert err.value.status == 400


def test_node_name_selector_follows_pods_that_are_bound_moved_in_and_deleted(core_v1: client.CoreV1Api) -> None:
    def on(node: str, namespace: str | None = None) -> list[str]:
        selector = f"spec.nodeName={node}"
        if namespace is None:
            return names_of(core_v1.list_pod_for_all_namespaces(field_selector=selector))
        return names_of(core_v1.list_namespaced_pod(namespace, field_selector=selector))

    core_v1.create_namespaced_pod("default", make_pod("a"))
    core_v1.create_namespaced_pod("default", make_pod("b", "n1"))
    core_v1.create_namespaced_pod("other", make_pod("c", "n1"))
    assert (on(""), on("n1"), on("n1", "other"), on("n2")) == (["a"], ["b", "c"], ["c"], [])
    body = client.V1Binding(metadata=client.V1ObjectMeta(name="a"), target=client.V1ObjectReference(name="n2"))
    core_v1.create_namespaced_pod_binding("a", "default", body, _preload_content=False)
    core_v1.delete_namespaced_pod("b", "default")
    assert (on(""), on("n1"), on("n2")) == ([], ["c"], ["a"])
    # a pod created again under a deleted one's name is indexed afresh
    core_v1.create_namespaced_pod("default", make_pod("b", "n2"))
    assert on("n2") == ["a", "b"]
    assert names_of(core_v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n2,metadata.name=b")) == ["b"]


def names_of(pods: client.V1PodList) -> list[str]:
    return sorted(p.metadata.name for p in pods.items)


def test_patches_and_resource_version_preconditions(core_v1: client.CoreV1Api) -> None:
    created = core_v1.create_namespaced_pod("default", make_pod("a"))
    rv = created.metadata.resource_version
    patched = core_v1.patch_namespaced_pod("a", "default", {"metadata": {"annotations": {"k": "v", "x": "1"}}})
    assert patched.metadata.annotations == {"k": "v", "x": "1"}
    assert int(patched.metadata.resource_version) > int(rv)
    # a stale resourceVersion in the patch is a failed precondition: 409, nothing written
    with pytest.raises(ApiException) as err:
        core_v1.patch_namespaced_pod("a", "default", {"metadata": {"resourceVersion": rv, "annotations": {"k": "w"}}})
    assert err.value.status == 409 and status_of(err.value)["reason"] == "Conflict"
    assert core_v1.read_namespaced_pod("a", "default").metadata.annotations["k"] == "v"
    # null deletes a key (merge patch)
    removed = core_v1.patch_namespaced_pod("a", "default", {"metadata": {"annotations": {"x": None}}})
    assert removed.metadata.annotations == {"k": "v"}
    # JSON patch with a test operation
    ok = core_v1.patch_namespaced_pod(
        "a",
        "default",
        [
            {"op": "test", "path": "/metadata/annotations/k", "value": "v"},
            {"op": "replace", "path": "/metadata/annotations/k", "value": "z"},
        ],
    )
    assert ok.metadata.annotations == {"k": "z"}
    with pytest.raises(ApiException) as err:
        core_v1.patch_namespaced_pod("a", "default", [{"op": "test", "path": "/metadata/annotations/k", "value": "v"}])
    assert err.value.status == 422


def test_errors_have_status_bodies(core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a"))
    with pytest.raises(ApiException) as err:
        core_v1.create_namespaced_pod("default", make_pod("a"))
    assert err.value.status == 409 and status_of(err.value)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as err:
        core_v1.read_namespaced_pod("missing", "default")
    body = status_of(err.value)
    assert (err.value.status, body["kind"], body["reason"], body["details"]["name"]) == (
        404,
        "Status",
        "NotFound",
        "missing",
    )
    with pytest.raises(ApiException) as err:
        core_v1.create_namespaced_pod("default", {"metadata": {}, "spec": {"containers": []}})
    assert err.value.status == 422


def test_binding_subresource(core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a"))
    target = client.V1ObjectReference(kind="Node", name="n1")
    body = client.V1Binding(metadata=client.V1ObjectMeta(name="a"), target=target)
    core_v1.create_namespaced_pod_binding("a", "default", body, _preload_content=False)
    assert core_v1.read_namespaced_pod("a", "default").spec.node_name == "n1"
    body.target = client.V1ObjectReference(kind="Node", name="n2")
    with pytest.raises(ApiException) as err:
        core_v1.create_namespaced_pod_binding("a", "default", body, _preload_content=False)
    assert err.value.status == 409 and "already assigned" in status_of(err.value)["message"]
    with pytest.raises(ApiException) as err:
        core_v1.create_namespaced_pod_binding("ghost", "default", body, _preload_content=False)
    assert err.value.status == 404


def test_status_subresource_and_nodes_and_events(core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a"))
    core_v1.patch_namespaced_pod_status("a", "default", {"status": {"phase": "Running"}})
    assert core_v1.read_namespaced_pod_status("a", "default").status.phase == "Running"
    core_v1.create_node({"metadata": {"name": "n1", "labels": {"gpu": "yes"}}})
    core_v1.patch_node("n1", {"metadata": {"annotations": {"inv": "1"}}})
    core_v1.patch_node_status("n1", {"status": {"capacity": {"aliyun.com/gpu-mem": "80"}}})
    node = core_v1.read_node("n1")
    assert node.metadata.annotations == {"inv": "1"} and node.status.capacity == {"aliyun.com/gpu-mem": "80"}
    assert [n.metadata.name for n in core_v1.list_node(label_selector="gpu=yes").items] == ["n1"]
    event = {
        "metadata": {"generateName": "a."},
        "involvedObject": {"kind": "Pod", "name": "a"},
        "reason": "R",
        "message": "m",
    }
    core_v1.create_namespaced_event("default", event)
    assert [e.reason for e in core_v1.list_namespaced_event("default").items] == ["R"]


def test_watch_resumes_from_a_resource_version(core_v1: client.CoreV1Api) -> None:
    listed = core_v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    start = listed.metadata.resource_version
    core_v1.create_namespaced_pod("default", make_pod("a", "n1"))
    core_v1.create_namespaced_pod("default", make_pod("b", "n2"))  # filtered out
    core_v1.patch_namespaced_pod("a", "default", {"metadata": {"labels": {"x": "1"}}})
    core_v1.delete_namespaced_pod("a", "default")
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core_v1.list_pod_for_all_namespaces,
            field_selector="spec.nodeName=n1",
            resource_version=start,
            timeout_seconds=1,
        )
    ]
    assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]


def test_watch_sees_live_changes_in_order(core_v1: client.CoreV1Api) -> None:
    rv = core_v1.list_node().metadata.resource_version
    got: list[str] = []
    ready = threading.Event()

    def follow() -> None:
        ready.set()
        for e in watch.Watch().stream(core_v1.list_node, resource_version=rv, timeout_seconds=5):
            got.append(f"{e['type']} {e['object'].metadata.name}")
            if len(got) == 3:
                return

    t = threading.Thread(target=follow)
    t.start()
    ready.wait()
    for name in ("n1", "n2"):
        core_v1.create_node({"metadata": {"name": name}})
    core_v1.delete_node("n1")
    t.join(10)
    assert got == ["ADDED n1", "ADDED n2", "DELETED n1"]


def test_too_old_resource_version_gets_410(apiserver: ApiServer, core_v1: client.CoreV1Api, monkeypatch) -> None:
    from gpushare.sandbox import store

    small = store.Store()
    small._history = type(small._history)(maxlen=2)
    monkeypatch.setattr(apiserver, "store", small)
    for i in range(5):
        core_v1.create_node({"metadata": {"name": f"n{i}"}})
    with pytest.raises(ApiException) as err:
        for _ in watch.Watch().stream(core_v1.list_node, resource_version="1", timeout_seconds=1):
            pass
    assert err.value.status == 410


def test_outage_and_recovery_keep_state(apiserver: ApiServer, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a"))
    apiserver.pause()
    with pytest.raises(Exception, match=r"Connection refused|Max retries"):
        core_v1.read_namespaced_pod("a", "default", _request_timeout=1)
    apiserver.resume()
    wait_until(lambda: core_v1.read_namespaced_pod("a", "default").metadata.name == "a")
