"""The admission decision, pure: may this user create or update this pod, given what it does to the
annotations that only the extender and the node agent may write?"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.errors import quoted
from gpushare.contract.keycheck import unknown_keys
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
    #: shown to whoever made the request (kubectl prints them), whether it is allowed or not
    warnings: tuple[str, ...] = ()


def touched(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """The protected annotation keys that ``new`` adds, removes or changes relative to ``old``."""
    return sorted(k for k in set(old) | set(new) if protected_annotation(k) and old.get(k) != new.get(k))


def review(body: Any, trusted: Iterable[str] = DEFAULT_TRUSTED) -> Verdict:
    """The verdict on an ``admission.k8s.io/v1`` AdmissionReview of a pod CREATE or UPDATE, or of a
    write to one of the pod's subresources that can change its annotations: an UPDATE of
    ``pods/status`` (the API server keeps the pod's spec but takes its metadata from the request), and
    a CREATE of ``pods/binding``, whose object is a Binding whose annotations the API server copies
    onto the pod. (``pods/ephemeralcontainers`` and ``pods/resize`` keep the pod's metadata as it was.)"""
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
    # the pod itself (not its status or binding): what the tenant wrote and gpushare would ignore
    warnings = tuple(k.message() for k in unknown_keys(new, old)) if not request.get("subResource") else ()
    if not changed:
        return Verdict(uid, True, warnings=warnings)
    subresource = request.get("subResource") or ""
    creating = request["operation"] == "CREATE"
    key = pod_key(new if creating else old or new)
    if subresource == "binding":
        what = f"bind pod {key}"
    elif creating:
        what = f"create pod {key}"
    else:
        what = f"change annotations on pod {key}" + (f" through pods/{subresource}" if subresource else "")
    return Verdict(
        uid,
        False,
        f"{quoted(user)} may not {what} with {quoted(', '.join(changed), limit=400)}: "
        "only the gpushare scheduler extender and node agent write them",
        warnings,
    )


def response(verdict: Verdict) -> dict[str, Any]:
    reply: dict[str, Any] = {"uid": verdict.uid, "allowed": verdict.allowed}
    if not verdict.allowed:
        reply["status"] = {"code": 403, "reason": "Forbidden", "message": verdict.message}
    if verdict.warnings:
        reply["warnings"] = list(verdict.warnings)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": reply}
