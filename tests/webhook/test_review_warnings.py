"""The webhook warns whoever writes a pod of the keys gpushare would ignore (a typo of its own), naming
the key it most likely meant; kubectl prints an AdmissionReview's warnings."""

from __future__ import annotations

from typing import Any

from gpushare.webhook.review import DEFAULT_TRUSTED, response, review
from podfactory import container, gpu_pod

from gpushare.contract.names import ANN_ALLOCATION

TENANT = "system:serviceaccount:team-a:default"
WARNING = "gpushare ignores annotation 'gpushare.io/gpu-modle': did you mean 'gpushare.io/gpu-model'?"


def request(operation: str, new: dict[str, Any], old: dict[str, Any] | None = None, user: str = TENANT) -> dict:
    body = {"uid": "u1", "operation": operation, "userInfo": {"username": user}, "object": new, "oldObject": old}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": body}


def pod(**annotations: str) -> dict[str, Any]:
    return gpu_pod("train", [container("main", 4)], node=None, extra_annotations=annotations)


def test_a_typo_outside_gpushares_prefix_is_admitted_with_a_warning_naming_the_key_it_meant() -> None:
    reply = response(review(request("CREATE", pod(**{"gpushare.oi/gpu-model": "A10"}))))["response"]
    assert reply["allowed"] is True
    assert reply["warnings"] == [
        "gpushare ignores annotation 'gpushare.oi/gpu-model': did you mean 'gpushare.io/gpu-model'?"
    ]


def test_a_typo_under_gpushares_prefix_is_refused_and_the_warning_names_the_key_it_meant() -> None:
    """Every unknown gpushare.io/ key is gpushare's to write; the warning says what the tenant meant."""
    reply = response(review(request("CREATE", pod(**{"gpushare.io/gpu-modle": "A10"}))))["response"]
    assert reply["allowed"] is False and "'gpushare.io/gpu-modle'" in reply["status"]["message"]
    assert reply["warnings"] == [WARNING]


def test_a_refused_pod_carries_its_warnings_too() -> None:
    body = pod(**{"gpushare.oi/gpu-model": "A10", ANN_ALLOCATION: "{}"})
    reply = response(review(request("CREATE", body)))["response"]
    assert reply["allowed"] is False and len(reply["warnings"]) == 1


def test_no_warning_without_a_mistake_nor_for_a_key_an_update_keeps() -> None:
    assert "warnings" not in response(review(request("CREATE", pod(**{"example.com/x": "1"}))))["response"]
    old = pod(**{"gpushare.io/gpu-modle": "A10"})
    new = pod(**{"gpushare.io/gpu-modle": "A10", "team": "a"})
    assert "warnings" not in response(review(request("UPDATE", new, old)))["response"]


def test_gpushare_itself_is_not_warned() -> None:
    extender = DEFAULT_TRUSTED[0]
    verdict = review(request("CREATE", pod(**{"gpushare.io/gpu-modle": "A10"}), user=extender))
    assert verdict.allowed and verdict.warnings == ()
