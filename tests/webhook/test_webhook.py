"""The admission webhook: who may write gpushare's pod annotations, decided without I/O and served
over HTTPS as the API server calls it."""

from __future__ import annotations

import http.client
import json
import logging
import ssl
from pathlib import Path
from typing import Any

import pytest
from gpushare.webhook.review import DEFAULT_TRUSTED, review
from gpushare.webhook.server import WebhookServer
from podfactory import container, gpu_pod, slices
from tlscerts import make_certs

from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_ASSIGNED_CONTAINERS,
    ANN_GANG_HOLD,
    ANN_GPU_MODEL,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_IDX,
    ANN_POLICY,
    ANN_REQUIRE_NVLINK,
    protected_annotation,
)
from gpushare.gpus.simulated import simulated_cards
from gpushare.tlshttp import ServerTLS

EXTENDER, NODE_AGENT = DEFAULT_TRUSTED
TENANT = "system:serviceaccount:team-a:default"
A0, A1 = simulated_cards("n1", "2xA100-80GB:81920")


def admission(
    operation: str, user: str, new: dict[str, Any], old: dict[str, Any] | None = None, subresource: str = ""
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "req-1",
            "operation": operation,
            "userInfo": {"username": user},
            "object": new,
            "oldObject": old,
            **({"subResource": subresource} if subresource else {}),
        },
    }


def bound(card: Any = A0) -> dict[str, Any]:
    """A pod as the extender leaves it."""
    return gpu_pod("train", [container("main", 80)], allocation={"main": slices([card], 80)}, assume_ns=1)


def plain(**annotations: str) -> dict[str, Any]:
    return gpu_pod("train", [container("main")], node=None, extra_annotations=annotations)


def test_a_pod_created_with_a_forged_allocation_is_rejected() -> None:
    verdict = review(admission("CREATE", TENANT, bound()))
    assert not verdict.allowed and ANN_ALLOCATION in verdict.message and TENANT in verdict.message
    forged_original = plain(**{ANN_MEM_IDX: "0"})
    assert not review(admission("CREATE", TENANT, forged_original)).allowed


def test_a_running_pod_may_not_move_its_own_allocation() -> None:
    verdict = review(admission("UPDATE", TENANT, bound(A1), bound(A0)))
    assert not verdict.allowed and "change annotations on pod default/train" in verdict.message
    stripped = bound(A0)
    del stripped["metadata"]["annotations"][ANN_ALLOCATION]
    assert not review(admission("UPDATE", TENANT, stripped, bound(A0))).allowed


def test_gpushare_may_write_and_tenants_may_touch_everything_else() -> None:
    assert review(admission("UPDATE", EXTENDER, bound(A1), bound(A0))).allowed
    assert review(admission("UPDATE", NODE_AGENT, bound(A1), bound(A0))).allowed
    relabelled = bound(A0)
    relabelled["metadata"]["annotations"]["team"] = "a"
    assert review(admission("UPDATE", TENANT, relabelled, bound(A0))).allowed
    assert review(admission("CREATE", TENANT, plain(**{ANN_POLICY: "spread", "team": "a"}))).allowed
    rule = {ANN_GPU_MODEL: "A100", ANN_REQUIRE_NVLINK: "true"}
    assert review(admission("CREATE", TENANT, plain(**rule))).allowed


def test_annotations_rewritten_through_pods_status_are_refused_and_a_status_update_is_not() -> None:
    verdict = review(admission("UPDATE", TENANT, bound(A1), bound(A0), "status"))
    assert not verdict.allowed
    assert "may not change annotations on pod default/train through pods/status" in verdict.message
    running = bound(A0)
    running["status"] = {"phase": "Running"}
    assert review(admission("UPDATE", "system:node:n1", running, bound(A0), "status")).allowed


def test_a_binding_carrying_gpushare_annotations_is_refused_unless_the_extender_binds() -> None:
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "train", "namespace": "default", "annotations": {ANN_MEM_IDX: "0"}},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    verdict = review(admission("CREATE", TENANT, binding, None, "binding"))
    assert not verdict.allowed and f"may not bind pod default/train with '{ANN_MEM_IDX}'" in verdict.message
    assert review(admission("CREATE", EXTENDER, binding, None, "binding")).allowed
    plain_binding = {**binding, "metadata": {"name": "train", "namespace": "default"}}
    assert review(admission("CREATE", "system:kube-scheduler", plain_binding, None, "binding")).allowed


def test_served_over_https_as_an_admission_review(tmp_path: Path) -> None:
    certs = make_certs(tmp_path, ("gpushare-webhook.gpushare-system.svc",))
    server = WebhookServer(0, ServerTLS(certs.server.cert, certs.server.key, None), host="127.0.0.1")
    server.start()
    try:
        conn = http.client.HTTPSConnection(
            "127.0.0.1", server.port, context=ssl.create_default_context(cafile=certs.ca), timeout=10
        )
        conn.request("POST", "/validate", json.dumps(admission("CREATE", TENANT, bound())))
        reply = json.loads(conn.getresponse().read())
        assert reply["kind"] == "AdmissionReview" and reply["response"]["uid"] == "req-1"
        assert reply["response"]["allowed"] is False and reply["response"]["status"]["code"] == 403
        conn.request("POST", "/validate", b'{"request": "x"}')
        assert conn.getresponse().status == 400
        conn.close()
    finally:
        server.stop()


def test_a_flood_of_deeply_nested_json_is_refused_quietly_and_the_webhook_keeps_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who reaches the webhook's port may post (it serves the API server, which shows no client
    certificate): JSON nested deeper than any AdmissionReview is a 400 saying so, not a traceback."""
    certs = make_certs(tmp_path, ("gpushare-webhook.gpushare-system.svc",))
    server = WebhookServer(0, ServerTLS(certs.server.cert, certs.server.key, None), host="127.0.0.1")
    server.start()
    conn = http.client.HTTPSConnection(
        "127.0.0.1", server.port, context=ssl.create_default_context(cafile=certs.ca), timeout=10
    )
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(300):
                conn.request("POST", "/validate", b"[" * 5000)
                reply = conn.getresponse()
                assert reply.status == 400
                assert "nests more than 64 arrays and objects deep" in json.loads(reply.read())["error"]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        conn.request("POST", "/validate", json.dumps(admission("CREATE", EXTENDER, bound())))
        reply = conn.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["response"]["allowed"] is True
    finally:
        conn.close()
        server.stop()


@pytest.mark.parametrize(
    "key", [ANN_ALLOCATION, ANN_ASSIGNED_CONTAINERS, ANN_GANG_HOLD, ANN_MEM_ASSUME_TIME, ANN_MEM_IDX]
)
def test_every_key_the_components_trust_is_protected(key: str) -> None:
    assert protected_annotation(key) and not protected_annotation(ANN_POLICY)
