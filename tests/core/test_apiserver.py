"""Kubernetes API semantics the components rely on (patch formats, preconditions, selectors, watch scope,
errors), driven through the official client against both the API server stand-in and a real
kube-apiserver: the real one is the reference the stand-in must match. Outages and history limits are
the stand-in's own controls and are tested on it alone."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from podfactory import container, gpu_pod
from support.realapi import real_api_server
from support.waiting import wait_until

from gpushare.kube.errors import KubeCacheBehind, KubeUnavailable
from gpushare.kube.events import EventRecorder
from gpushare.kube.objects import list_pods
from gpushare.kube.transport import load_api, translate
from gpushare.sandbox.apiserver import ApiServer

MERGE = "application/merge-patch+json"
#: namespaces the tests write to; a real API server only accepts objects in namespaces that exist
NAMESPACES = ("default", "other")
STANDIN_ONLY = pytest.mark.parametrize("core_v1", ["stand-in"], indirect=True)


@pytest.fixture(scope="session")
def real_api() -> Iterator[client.ApiClient]:
    """etcd and kube-apiserver alone, shared by the session; each test starts from an emptied state."""
    with real_api_server() as real:
        core = client.CoreV1Api(real.api)
        for ns in NAMESPACES:
            if ns != "default":
                core.create_namespace({"metadata": {"name": ns}})
                real.wait_default_service_account(ns)
        yield real.api


def emptied(core: client.CoreV1Api) -> client.CoreV1Api:
    """Remove what earlier tests left: pods (at once, bound or not), events and nodes."""
    for ns in NAMESPACES:
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        core.delete_collection_namespaced_event(ns)
    core.delete_collection_node()
    wait_until(
        lambda: not core.list_pod_for_all_namespaces().items and not core.list_node().items,
        10,
        "the real API server to be emptied",
    )
    return core


@pytest.fixture(params=["stand-in", "real"])
def core_v1(request: pytest.FixtureRequest) -> client.CoreV1Api:
    """CoreV1Api on the stand-in (the ``apiserver`` fixture) or on the session's real kube-apiserver."""
    if request.param == "real":
        return emptied(client.CoreV1Api(request.getfixturevalue("real_api")))
    return client.CoreV1Api(load_api(str(request.getfixturevalue("kubeconfig"))))


def make_pod(name: str, node: str | None = None, labels: dict[str, str] | None = None) -> dict:
    return gpu_pod(name, [container("c")], node=node, namespace=None, labels=labels or {})


def status_of(err: ApiException) -> dict:
    return json.loads(err.body)


def post_raw(core_v1: client.CoreV1Api, path: str, data: bytes) -> tuple[int, dict]:
    """POST bytes the client would never send, with the client's credentials; the status and the body."""
    api = core_v1.api_client
    headers = {"Content-Type": "application/json"}
    api.update_params_for_auth(headers, [], ["BearerToken"], path, "POST", None)
    reply = api.rest_client.pool_manager.request(
        "POST", api.configuration.host + path, body=data, headers=headers, timeout=5
    )
    return reply.status, json.loads(reply.data)


def failure(err: pytest.ExceptionInfo[ApiException]) -> tuple[int, str]:
    return err.value.status, status_of(err.value)["reason"]


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
    # selectable since 1.28 (1.20 refused it with 400); a pod that doesn't set it compares as false
    core_v1.create_namespaced_pod("other", {**make_pod("h", "n2"), "spec": {**make_pod("h", "n2")["spec"],
                                                                          "hostNetwork": True}})  # fmt: skip
    assert names(field_selector="spec.hostNetwork=true") == ["h"]
    assert names(field_selector="spec.hostNetwork=false") == ["a", "b", "c"]
    assert names(label_selector="app=x") == ["a"]
    assert names(label_selector="app in (x,y),tier") == ["a"]
    assert names(label_selector="!tier,app") == ["b"]
    assert [p.metadata.name for p in core_v1.list_namespaced_pod("other").items] == ["c", "h"]
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
    core_v1.delete_namespaced_pod("b", "default", grace_period_seconds=0)
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
    assert failure(err) == (400, "BadRequest") and "does not match" in status_of(err.value)["message"]
    body.metadata.name = "ghost"
    with pytest.raises(ApiException) as err:
        core_v1.create_namespaced_pod_binding("ghost", "default", body, _preload_content=False)
    assert failure(err) == (404, "NotFound")


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


def test_a_repeated_event_is_counted_on_the_event_already_written(core_v1: client.CoreV1Api) -> None:
    """The recorder's merge patch of ``count`` and ``lastTimestamp`` is accepted as it is written."""
    pod = core_v1.api_client.sanitize_for_serialization(core_v1.create_namespaced_pod("default", make_pod("a")))
    recorder = EventRecorder(core_v1.api_client, "gpushare")
    for message in ("m", "m", "n", "m"):
        recorder.record(pod, reason="R", message=message, type_="Warning")
    recorder.close()
    got = sorted(core_v1.list_namespaced_event("default").items, key=lambda e: e.message)
    assert [(e.message, e.count, e.involved_object.uid) for e in got] == [
        ("m", 3, pod["metadata"]["uid"]),
        ("n", 1, pod["metadata"]["uid"]),
    ]
    assert got[0].last_timestamp >= got[0].first_timestamp


def test_watch_resumes_from_a_resource_version(core_v1: client.CoreV1Api) -> None:
    listed = core_v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    start = listed.metadata.resource_version
    core_v1.create_namespaced_pod("default", make_pod("a", "n1"))
    core_v1.create_namespaced_pod("default", make_pod("b", "n2"))  # filtered out
    core_v1.patch_namespaced_pod("a", "default", {"metadata": {"labels": {"x": "1"}}})
    core_v1.delete_namespaced_pod("a", "default", grace_period_seconds=0)
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core_v1.list_pod_for_all_namespaces,
            field_selector="spec.nodeName=n1",
            resource_version=start,
            timeout_seconds=1,
        )
    ]
    # a deletion is first a change (the pod is marked as being deleted), then the removal
    assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]


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


@STANDIN_ONLY
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


@STANDIN_ONLY
def test_outage_and_recovery_keep_state(apiserver: ApiServer, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a"))
    apiserver.pause()
    with pytest.raises(Exception, match=r"Connection refused|Max retries"):
        core_v1.read_namespaced_pod("a", "default", _request_timeout=1)
    apiserver.resume()
    wait_until(lambda: core_v1.read_namespaced_pod("a", "default").metadata.name == "a")


def test_json_patch_test_on_resource_version_is_a_compare_and_swap(core_v1: client.CoreV1Api) -> None:
    rv = core_v1.create_namespaced_pod("default", make_pod("a")).metadata.resource_version
    swap = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/annotations", "value": {"owner": "first"}},
    ]
    assert core_v1.patch_namespaced_pod("a", "default", swap).metadata.annotations == {"owner": "first"}
    swap[1]["value"] = {"owner": "second"}
    with pytest.raises(ApiException) as err:
        core_v1.patch_namespaced_pod("a", "default", swap)
    assert failure(err) == (422, "Invalid")
    assert core_v1.read_namespaced_pod("a", "default").metadata.annotations == {"owner": "first"}


def test_strategic_merge_merges_conditions_by_type_and_merge_patch_replaces(core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a"))
    scheduled = {"type": "PodScheduled", "status": "True"}
    core_v1.patch_namespaced_pod_status("a", "default", {"status": {"conditions": [scheduled]}})
    ready = {"type": "Ready", "status": "False"}
    core_v1.patch_namespaced_pod_status("a", "default", {"status": {"conditions": [ready]}})
    flipped = {"type": "Ready", "status": "True"}
    pod = core_v1.patch_namespaced_pod_status("a", "default", {"status": {"conditions": [flipped]}})
    # kube-apiserver's order: a condition the patch adds comes before the stored ones it leaves alone
    assert [(c.type, c.status) for c in pod.status.conditions] == [("Ready", "True"), ("PodScheduled", "True")]
    drop = {"status": {"conditions": [{"type": "PodScheduled", "$patch": "delete"}]}}
    pod = core_v1.patch_namespaced_pod_status("a", "default", drop)
    assert [c.type for c in pod.status.conditions] == ["Ready"]
    replace = {"status": {"conditions": [scheduled]}}
    pod = core_v1.patch_namespaced_pod_status("a", "default", replace, _content_type=MERGE)
    assert [c.type for c in pod.status.conditions] == ["PodScheduled"]


def test_status_subresource_keeps_the_spec_takes_the_metadata_and_checks_versions(core_v1: client.CoreV1Api) -> None:
    created = core_v1.create_namespaced_pod("default", make_pod("a", labels={"app": "x"}))
    body = {"metadata": {"name": "a", "resourceVersion": created.metadata.resource_version}}
    running = core_v1.replace_namespaced_pod_status("a", "default", {**body, "status": {"phase": "Running"}})
    # kube-apiserver 1.20 takes labels and annotations from a status write too: these had none
    assert running.status.phase == "Running" and not running.metadata.labels
    assert running.spec.containers[0].name == "c"
    with pytest.raises(ApiException) as err:  # the same version again is now stale
        core_v1.replace_namespaced_pod_status("a", "default", {**body, "status": {"phase": "Failed"}})
    assert failure(err) == (409, "Conflict")
    assert core_v1.read_namespaced_pod_status("a", "default").status.phase == "Running"


def test_malformed_requests_get_the_right_status(core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a"))
    with pytest.raises(ApiException) as err:
        core_v1.patch_namespaced_pod("a", "default", {"metadata": {}}, _content_type="application/apply-patch+yaml")
    assert failure(err) == (422, "Invalid") and "fieldManager" in status_of(err.value)["message"]
    with pytest.raises(ApiException) as err:
        core_v1.patch_namespaced_pod("a", "default", {"metadata": {}}, _content_type="application/bogus+json")
    assert failure(err) == (415, "UnsupportedMediaType")
    # the refused body must not leak into the next request on the same connection
    with pytest.raises(ApiException) as err:
        core_v1.patch_namespaced_pod("a", "default", [{"op": "add"}], _content_type=MERGE)
    # 422 Invalid up to 1.26; since 1.27 the server decodes the patch strictly first
    assert failure(err) == (400, "BadRequest") and "error decoding patch" in status_of(err.value)["message"]
    status, body = post_raw(core_v1, "/api/v1/namespaces/default/pods", b"{not json")
    assert status == 400 and body["kind"] == "Status"
    with pytest.raises(ApiException) as err:
        core_v1.delete_namespaced_pod("ghost", "default")
    assert failure(err) == (404, "NotFound")


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("tier notin (web)", ["b", "c"]),
        ("app==x", ["a"]),
        ("app!=x", ["b", "c"]),
        ("app in (x, y), !tier", ["b"]),
        ("tier", ["a"]),
    ],
)
def test_label_selector_forms(core_v1: client.CoreV1Api, selector: str, expected: list[str]) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a", labels={"app": "x", "tier": "web"}))
    core_v1.create_namespaced_pod("default", make_pod("b", labels={"app": "y"}))
    core_v1.create_namespaced_pod("default", make_pod("c"))
    assert sorted(p.metadata.name for p in core_v1.list_namespaced_pod("default", label_selector=selector).items) == (
        expected
    )


@pytest.mark.parametrize("selector", ["app in (x", "=x", "a b"])
def test_invalid_label_selector_is_400(core_v1: client.CoreV1Api, selector: str) -> None:
    with pytest.raises(ApiException) as err:
        core_v1.list_namespaced_pod("default", label_selector=selector)
    assert failure(err) == (400, "BadRequest")


def test_phase_field_selectors(core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a", "n1"))
    core_v1.create_namespaced_pod("default", make_pod("b", "n1"))
    core_v1.patch_namespaced_pod_status("b", "default", {"status": {"phase": "Running"}})

    def names(selector: str) -> list[str]:
        return [p.metadata.name for p in core_v1.list_pod_for_all_namespaces(field_selector=selector).items]

    assert names("status.phase=Running") == ["b"]
    assert names("spec.nodeName==n1,status.phase!=Running") == ["a"]
    assert names("metadata.name=a") == ["a"]


def test_a_binding_naming_another_uid_and_binding_again_even_to_the_same_node_are_conflicts(
    core_v1: client.CoreV1Api,
) -> None:
    uid = core_v1.create_namespaced_pod("default", make_pod("a")).metadata.uid

    def bind(node: str, uid: str) -> None:
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name="a", uid=uid),
            target=client.V1ObjectReference(kind="Node", name=node),
        )
        core_v1.create_namespaced_pod_binding("a", "default", body, _preload_content=False)

    with pytest.raises(ApiException) as err:
        bind("n1", "not-the-uid")  # kube-apiserver 1.20 took this; since 1.24 the uid is a precondition
    assert failure(err) == (409, "Conflict") and "UID in precondition: not-the-uid" in status_of(err.value)["message"]
    assert not core_v1.read_namespaced_pod("a", "default").spec.node_name
    bind("n1", uid)
    with pytest.raises(ApiException) as err:
        bind("n1", uid)
    assert failure(err) == (409, "Conflict") and 'already assigned to node "n1"' in status_of(err.value)["message"]
    pod = core_v1.read_namespaced_pod("a", "default")
    assert pod.spec.node_name == "n1"
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True")]


def test_a_pod_on_a_node_is_deleted_gracefully_until_deleted_with_no_grace(core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("bound", "n1"))
    core_v1.create_namespaced_pod("default", make_pod("pending"))
    core_v1.create_namespaced_pod("default", make_pod("done", "n1"))
    core_v1.patch_namespaced_pod_status("done", "default", {"status": {"phase": "Succeeded"}})
    for name in ("bound", "pending", "done"):
        core_v1.delete_namespaced_pod(name, "default")
    # only the running pod stays, marked, with the default grace period, until kubelet deletes it with none
    (left,) = core_v1.list_namespaced_pod("default").items
    assert left.metadata.name == "bound" and left.metadata.deletion_timestamp is not None
    assert left.metadata.deletion_grace_period_seconds == 30
    core_v1.delete_namespaced_pod("bound", "default", grace_period_seconds=0)
    assert core_v1.list_namespaced_pod("default").items == []


def test_watch_reports_objects_leaving_and_entering_the_selector(core_v1: client.CoreV1Api) -> None:
    start = core_v1.list_namespaced_pod("default").metadata.resource_version
    core_v1.create_namespaced_pod("default", make_pod("a"))
    core_v1.patch_namespaced_pod_status("a", "default", {"status": {"phase": "Running"}})
    core_v1.patch_namespaced_pod_status("a", "default", {"status": {"phase": "Pending"}})
    seen = [
        e["type"]
        for e in watch.Watch().stream(
            core_v1.list_namespaced_pod,
            "default",
            field_selector="status.phase=Pending",
            resource_version=start,
            timeout_seconds=1,
        )
    ]
    assert seen == ["ADDED", "DELETED", "ADDED"]


def test_watch_from_zero_replays_the_current_state(core_v1: client.CoreV1Api) -> None:
    core_v1.create_node({"metadata": {"name": "n1"}})
    core_v1.create_namespaced_pod("default", make_pod("unrelated"))
    events = list(
        watch.Watch().stream(core_v1.list_node, resource_version="0", timeout_seconds=1, allow_watch_bookmarks=True)
    )
    seen = [(e["type"], e["raw_object"]["metadata"].get("name")) for e in events]
    # since 1.27 (not in 1.20) a bookmark at once marks the end of the replayed state
    assert seen == [("ADDED", "n1"), ("BOOKMARK", None)]
    end = events[1]["raw_object"]["metadata"]
    assert end["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert int(end["resourceVersion"]) >= int(events[0]["raw_object"]["metadata"]["resourceVersion"])


def test_concurrent_writers_are_all_seen_by_a_watch_in_order(core_v1: client.CoreV1Api) -> None:
    start = core_v1.list_namespaced_pod("default").metadata.resource_version
    writers, per_writer = 12, 10
    seen: list[tuple[str, int]] = []
    done = threading.Event()

    def follow() -> None:
        for e in watch.Watch().stream(
            core_v1.list_namespaced_pod, "default", resource_version=start, timeout_seconds=20
        ):
            seen.append((e["object"].metadata.name, int(e["object"].metadata.resource_version)))
            if len(seen) == writers * per_writer:
                done.set()
                return

    def write(w: int) -> None:
        for i in range(per_writer):
            core_v1.create_namespaced_pod("default", make_pod(f"w{w}-{i}"))

    follower = threading.Thread(target=follow)
    follower.start()
    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert done.wait(20)
    follower.join(5)
    versions = [rv for _, rv in seen]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert {name for name, _ in seen} == {f"w{w}-{i}" for w in range(writers) for i in range(per_writer)}


@STANDIN_ONLY
def test_pause_breaks_open_watches_and_resume_serves_the_same_state(
    apiserver: ApiServer, core_v1: client.CoreV1Api
) -> None:
    core_v1.create_node({"metadata": {"name": "n1"}})
    port = apiserver.port
    seen: list[str] = []
    outcome: list[BaseException | None] = []

    def follow() -> None:
        try:
            for e in watch.Watch().stream(core_v1.list_node, timeout_seconds=30):
                seen.append(e["type"])
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    follower = threading.Thread(target=follow)
    follower.start()
    wait_until(lambda: seen == ["ADDED"], what="the watch to replay the node")
    apiserver.pause()
    follower.join(10)
    assert outcome and outcome[0] is not None, "a paused server must break the stream, not end it cleanly"
    apiserver.resume()
    assert apiserver.port == port
    assert core_v1.read_node("n1", _request_timeout=5).metadata.name == "n1"


def test_field_selectors_are_per_resource(core_v1: client.CoreV1Api) -> None:
    for name in ("p", "q"):
        uid = core_v1.create_namespaced_pod("default", make_pod(name, "n1")).metadata.uid
        event = {
            "metadata": {"generateName": f"{name}."},
            "involvedObject": {"kind": "Pod", "name": name, "namespace": "default", "uid": uid},
            "reason": "Refused",
            "type": "Warning",
            "source": {"component": "gpushare"},
        }
        core_v1.create_namespaced_event("default", event)
    about_p = "involvedObject.name=p,involvedObject.namespace=default,involvedObject.kind=Pod,type=Warning"
    assert [e.involved_object.name for e in core_v1.list_namespaced_event("default", field_selector=about_p).items] == [
        "p"
    ]
    assert len(core_v1.list_namespaced_event("default", field_selector="source=gpushare,reason=Refused").items) == 2
    assert core_v1.list_node(field_selector="spec.unschedulable=true").items == []
    for wrong in (
        lambda: core_v1.list_namespaced_pod("default", field_selector="involvedObject.name=p"),
        lambda: core_v1.list_node(field_selector="spec.nodeName=n1"),
    ):
        with pytest.raises(ApiException) as err:
            wrong()
        assert failure(err) == (400, "BadRequest")


def test_pods_listed_at_a_nodes_version_are_listed_even_when_no_pod_event_reaches_it(
    core_v1: client.CoreV1Api,
) -> None:
    """A bind lists the node's pods at the node's resourceVersion. A node written after the last pod event
    has a version the pod watch cache never reaches on its own (a real API server answers 504 after 3 s);
    the pods must still be listed."""
    core_v1.create_namespaced_pod("default", make_pod("a", "n1"))
    node = core_v1.create_node({"metadata": {"name": "n1", "annotations": {"note": "later than the pod"}}})
    pods = list_pods(
        core_v1.api_client, field_selector="spec.nodeName=n1", resource_version=node.metadata.resource_version
    )
    assert [p["metadata"]["name"] for p in pods] == ["a"]


def test_a_watch_cache_that_is_behind_is_told_apart_from_an_outage() -> None:
    body = json.dumps(
        {"kind": "Status", "code": 504, "reason": "Timeout", "message": "Too large resource version",
         "details": {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}]}}
    )  # fmt: skip
    behind = ApiException(status=504, reason="Gateway Timeout")
    behind.body = body
    assert isinstance(translate(behind, "list pods"), KubeCacheBehind)
    plain = ApiException(status=504, reason="Gateway Timeout")
    assert type(translate(plain, "list pods")) is KubeUnavailable
