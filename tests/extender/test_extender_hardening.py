"""The extender against hostile or broken input: what a request body may not decide, what a bind may
not do, and how a bind behaves when the API server fails or pauses underneath it."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
from podfactory import container, gpu_pod
from support.extender import Cluster

from gpushare.contract.aliyun import parse_assume_time
from gpushare.contract.errors import ContractError
from gpushare.contract.names import ANN_ALLOCATION, ENV_MEM_PREFIX, RESOURCE_MEM
from gpushare.holdings.pod import pod_allocation
from gpushare.kube import transport
from gpushare.sandbox import apiserver as standin


def annotations(cluster: Cluster, name: str) -> dict[str, str]:
    return cluster.core.read_namespaced_pod(name, "default").metadata.annotations or {}


# --- a request body can't decide what another request sees ---------------------------------


def test_a_sprayed_filter_body_does_not_change_what_bind_places(cluster: Cluster) -> None:
    """Bodies naming the uid and the next few resourceVersions of a real pod, with a smaller limit, are
    sent before the pod changes; then the pod changes and is bound."""
    pod = cluster.pod(gpu_pod("big", [container("main", 40)]))
    forged = json.loads(json.dumps(pod))
    forged["spec"]["containers"][0]["resources"]["limits"][RESOURCE_MEM] = "1"
    for ahead in range(1, 6):
        forged["metadata"]["resourceVersion"] = str(int(pod["metadata"]["resourceVersion"]) + ahead)
        cluster.filter(forged)
    cluster.core.patch_namespaced_pod("big", "default", {"metadata": {"labels": {"touched": "yes"}}})
    assert cluster.bind(pod, "n1")["Error"] == ""
    assert [s.units for s in cluster.allocation("big")["main"]] == [40]


# --- messages -----------------------------------------------------------------------------


def test_a_bad_request_names_the_pod_once(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("bad", [container("main")]))
    pod["spec"]["containers"][0]["resources"]["limits"][RESOURCE_MEM] = "lots"
    reason = cluster.filter(pod)["FailedAndUnresolvableNodes"]["n1"]
    assert reason.count("default/bad") == 1, reason


def test_untrusted_strings_are_quoted_and_cut() -> None:
    with pytest.raises(ContractError) as huge:
        parse_assume_time("9x" * 2500, "default/p")
    assert len(str(huge.value)) < 200 and "5000 characters" in str(huge.value)
    forged = json.dumps({"main\nERROR forged line": [{"index": 0, "uuid": "GPU-0", "units": 1}]})
    pod = gpu_pod("p", [container("main", 1)], extra_annotations={ANN_ALLOCATION: forged})
    with pytest.raises(ContractError) as named:
        pod_allocation(pod, ())
    assert "\n" not in str(named.value) and "forged line" in str(named.value)


# --- bind only what the filter would accept ---------------------------------------------------


def test_bind_refuses_a_pod_that_requests_no_gpu(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("plain", [container("main")]))
    assert "requests no gpushare resource" in cluster.bind(pod, "n2")["Error"]
    assert cluster.core.read_namespaced_pod("plain", "default").spec.node_name is None


def test_bind_refuses_a_node_outside_the_pods_node_selector(cluster: Cluster) -> None:
    spec = gpu_pod("picky", [container("main", 4)])
    spec["spec"]["nodeSelector"] = {"pool": "training"}
    pod = cluster.pod(spec)
    reply = cluster.bind(pod, "n2")
    assert "nodeSelector" in reply["Error"] and "'pool'='training'" in reply["Error"]
    assert cluster.core.read_namespaced_pod("picky", "default").spec.node_name is None
    assert ANN_ALLOCATION not in annotations(cluster, "picky")
    cluster.core.patch_node("n2", {"metadata": {"labels": {"pool": "training"}}})
    assert cluster.bind(pod, "n2")["Error"] == ""


# --- the per-node lock map ----------------------------------------------------------------


def test_binds_to_made_up_nodes_leave_no_locks_behind(cluster: Cluster) -> None:
    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    for _ in range(200):
        assert "not found" in cluster.bind(pod, f"nowhere-{uuid.uuid4().hex}")["Error"]
    assert cluster.extender.binder.locked_nodes == 0


# --- a failed bind leaves nothing behind, whatever the error --------------------------------


def test_a_forbidden_node_patch_takes_the_assignment_back(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    original = standin.ApiServer._patch

    def forbid_nodes(self: standin.ApiServer, h: Any, res: str, key: Any, status_only: bool) -> None:
        if res == "nodes":
            raise standin.StoreError(403, "Forbidden", f'nodes "{key[1]}" is forbidden: cannot patch resource')
        original(self, h, res, key, status_only)

    monkeypatch.setattr(standin.ApiServer, "_patch", forbid_nodes)
    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    reply = cluster.bind(pod, "n1")
    assert "403" in reply["Error"] and "taken back" in reply["Error"]
    left = annotations(cluster, "p")
    assert not [k for k in left if k.startswith(("gpushare.io/", ENV_MEM_PREFIX))], left
    assert cluster.extender.cache.assumed_on("n1") == []


# --- a pause in the middle of a bind --------------------------------------------------------


def test_a_bind_whose_answers_are_lost_in_an_api_pause_still_succeeds(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binding (which carries the annotations) lands, but its answer comes after the client gave up:
    the binding reports an error, yet the pod is bound here with this bind's annotations."""
    monkeypatch.setattr(transport, "REQUEST_TIMEOUT", (2.0, 0.3))
    released = threading.Event()
    delayed: list[str] = []
    original = standin._Handler._send

    def late(self: standin._Handler, code: int, body: Any) -> None:
        kind = "binding" if self.path.endswith("/binding") else "patch" if self.command == "PATCH" else ""
        if "/pods/" in self.path and kind and kind not in delayed:
            delayed.append(kind)
            released.wait(1.5)  # the API pause: longer than the client's read timeout
        original(self, code, body)

    monkeypatch.setattr(standin._Handler, "_send", late)
    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    reply = cluster.bind(pod, "n1")
    released.set()
    assert reply["Error"] == "", reply
    assert delayed == ["binding"]
    got = cluster.core.read_namespaced_pod("p", "default")
    assert got.spec.node_name == "n1" and ANN_ALLOCATION in got.metadata.annotations
