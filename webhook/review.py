"""The admission decision, pure: may this user create or update this pod, given what it does to the
annotations that only the extender and the node agent may write?"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.errors import quoted
from gpushare.contract.names import protected_annotation
from gpushare.contract.request import annotations_of, pod_key

#: the service accounts of deploy/rbac.yaml
DEFAULT_TRUSTED = (
    "system:serviceaccount:gpushare-system:gpushare-extender",
    "system:serviceaccount:gpushare-system:gpushare-node-agent",
)


class BadReview(ValueError):
    """The body isn't an AdmissionReview: HTTP 400."""


@dataclass(frozen=True, slots=True)
class Verdict:
    uid: str
    allowed: bool
    message: str = ""


def touched(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """The protected annotation keys that ``new`` adds, removes or changes relative to ``old``."""
    return sorted(k for k in set(old) | set(new) if protected_annotation(k) and old.get(k) != new.get(k))


def review(body: Any, trusted: Iterable[str] = DEFAULT_TRUSTED) -> Verdict:
    """The verdict on an ``admission.k8s.io/v1`` AdmissionReview of a pod CREATE or UPDATE."""
    request = body.get("request") if isinstance(body, dict) else None
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise BadReview("expected an AdmissionReview with a request and its uid")
    uid = request["uid"]
    user = (request.get("userInfo") or {}).get("username", "") if isinstance(request.get("userInfo"), dict) else ""
    new, old = request.get("object"), request.get("oldObject")
    if not isinstance(new, dict) or (old is not None and not isinstance(old, dict)):
        raise BadReview("object and oldObject must be objects")
    if request.get("operation") not in ("CREATE", "UPDATE") or user in set(trusted):
        return Verdict(uid, True)
    try:
        changed = touched(annotations_of(old or {}), annotations_of(new))
    except AttributeError:
        raise BadReview("metadata.annotations must be an object") from None
    if not changed:
        return Verdict(uid, True)
    verb = "create pod" if request["operation"] == "CREATE" else "change annotations on pod"
    return Verdict(
        uid,
        False,
        f"{quoted(user)} may not {verb} {pod_key(new if request['operation'] == 'CREATE' else old or new)} "
        f"with {quoted(', '.join(changed), limit=400)}: only the gpushare scheduler extender and node agent write them",
    )


def response(verdict: Verdict) -> dict[str, Any]:
    reply: dict[str, Any] = {"uid": verdict.uid, "allowed": verdict.allowed}
    if not verdict.allowed:
        reply["status"] = {"code": 403, "reason": "Forbidden", "message": verdict.message}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": reply}
