"""API server stand-in: the parts of the Kubernetes API semantics a component can trip over
(patch formats, preconditions, selectors, watch scope, outages), driven through the official client."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from conftest import wait_until
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from gpushare.sandbox.apiserver import ApiServer

MERGE = "application/merge-patch+json"


def make_pod(name: str, node: str | None = None, labels: dict[str, str] | None = None) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "busybox"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def failure(err: pytest.ExceptionInfo[ApiException]) -> tuple[int, str]:
    return err.value.status, json.loads(err.value.body)["reason"]


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
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True"), ("Ready", "True")]
    drop = {"status": {"conditions": [{"type": "PodScheduled", "$patch": "delete"}]}}
    pod = core_v1.patch_namespaced_pod_status("a", "default", drop)
    assert [c.type for c in pod.status.conditions] == ["Ready"]
    replace = {"status": {"conditions": [scheduled]}}
    pod = core_v1.patch_namespaced_pod_status("a", "default", replace, _content_type=MERGE)
    assert [c.type for c in pod.status.conditions] == ["PodScheduled"]


def test_status_subresource_keeps_metadata_and_checks_versions(core_v1: client.CoreV1Api) -> None:
    created = core_v1.create_namespaced_pod("default", make_pod("a", labels={"app": "x"}))
    body = {"metadata": {"name": "a", "resourceVersion": created.metadata.resource_version}}
    running = core_v1.replace_namespaced_pod_status("a", "default", {**body, "status": {"phase": "Running"}})
    assert running.status.phase == "Running" and running.metadata.labels == {"app": "x"}
    assert running.spec.containers[0].name == "c"
    with pytest.raises(ApiException) as err:  # the same version again is now stale
        core_v1.replace_namespaced_pod_status("a", "default", {**body, "status": {"phase": "Failed"}})
    assert failure(err) == (409, "Conflict")
    assert core_v1.read_namespaced_pod_status("a", "default").status.phase == "Running"


def test_malformed_requests_get_the_right_status(apiserver: ApiServer, core_v1: client.CoreV1Api) -> None:
    core_v1.create_namespaced_pod("default", make_pod("a"))
    with pytest.raises(ApiException) as err:
        core_v1.patch_namespaced_pod("a", "default", {"metadata": {}}, _content_type="application/apply-patch+yaml")
    assert failure(err) == (415, "UnsupportedMediaType")
    # the refused body must not leak into the next request on the same connection
    with pytest.raises(ApiException) as err:
        core_v1.patch_namespaced_pod("a", "default", [{"op": "add"}], _content_type=MERGE)
    assert failure(err) == (422, "Invalid")
    request = urllib.request.Request(
        f"{apiserver.url}/api/v1/namespaces/default/pods",
        data=b"{not json",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=5)
    assert http_err.value.code == 400 and json.loads(http_err.value.read())["kind"] == "Status"
    with pytest.raises(ApiException) as err:
        core_v1.delete_namespaced_pod("ghost", "default")
    assert failure(err) == (404, "NotFound")
    assert core_v1.read_namespace("anything").status.phase == "Active"


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


def test_binding_again_to_the_same_node_is_accepted_and_uid_is_checked(core_v1: client.CoreV1Api) -> None:
    uid = core_v1.create_namespaced_pod("default", make_pod("a")).metadata.uid

    def bind(node: str, pod_uid: str) -> None:
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name="a", uid=pod_uid), target=client.V1ObjectReference(kind="Node", name=node)
        )
        core_v1.create_namespaced_pod_binding("a", "default", body, _preload_content=False)

    with pytest.raises(ApiException) as err:
        bind("n1", "not-the-uid")
    assert failure(err) == (409, "Conflict")
    bind("n1", uid)
    bind("n1", uid)
    pod = core_v1.read_namespaced_pod("a", "default")
    assert pod.spec.node_name == "n1"
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True")]


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


def test_watch_from_zero_replays_state_then_ends_with_a_bookmark(core_v1: client.CoreV1Api) -> None:
    core_v1.create_node({"metadata": {"name": "n1"}})
    core_v1.create_namespaced_pod("default", make_pod("unrelated"))  # moves the version past the node
    latest = core_v1.list_node().metadata.resource_version
    stream = watch.Watch()
    seen = [
        (e["type"], e["raw_object"]["metadata"].get("name"))
        for e in stream.stream(core_v1.list_node, resource_version="0", timeout_seconds=1, allow_watch_bookmarks=True)
    ]
    assert seen == [("ADDED", "n1"), ("BOOKMARK", None)]
    assert stream.resource_version == latest


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
