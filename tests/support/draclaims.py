"""ResourceClaims as the API server returns them, the pods that use them, and the node's cards, for the
tests of the DRA plugin and of what a pod holds through its claims."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import podfactory

from gpushare.cards import Card
from gpushare.contract.resourceclaim import ClaimRef

NODE = "node-a"
REF = ClaimRef(namespace="ns", name="claim-1", uid="0b5c9f1e-1111-2222-3333-444455556666")
CARDS = (
    Card(index=0, uuid="GPU-aaaa", model="A100", memory_mib=81920, minor=0),
    Card(index=1, uuid="GPU-bbbb", model="A100", memory_mib=81920, minor=1),
)


def result(
    device: str = "card-0", memory: Any = "8Gi", request: str = "gpu", pool: str = NODE, **extra: Any
) -> dict[str, Any]:
    return {
        "request": request,
        "driver": "gpu.gpushare.io",
        "pool": pool,
        "device": device,
        "shareID": "dcd38910-fed2-4b80-8171-4063a68fb92f",
        "consumedCapacity": {"memory": memory},
        **extra,
    }


def claim(
    *results: dict[str, Any],
    uid: str = REF.uid,
    name: str = REF.name,
    namespace: str = REF.namespace,
    reserved_for: Sequence[str] = (),
) -> dict[str, Any]:
    """An allocated claim; ``reserved_for``: the uids of the pods in its ``status.reservedFor``."""
    status: dict[str, Any] = {"allocation": {"devices": {"results": list(results or (result(),))}}}
    if reserved_for:
        status["reservedFor"] = [{"resource": "pods", "name": f"pod-{u}", "uid": u} for u in reserved_for]
    return {"metadata": {"namespace": namespace, "name": name, "uid": uid}, "status": status}


def claim_pod(
    name: str, uid: str, claims: Sequence[str], namespace: str = REF.namespace, node: str = NODE
) -> dict[str, Any]:
    """A running pod on ``node`` whose container ``worker`` uses the ResourceClaims named ``claims``
    (``spec.resourceClaims[].resourceClaimName``) and which requests no gpushare resource."""
    entries = [f"c{i}" for i in range(len(claims))]
    worker = {**podfactory.container("worker"), "resources": {"claims": [{"name": e} for e in entries]}}
    pod = podfactory.gpu_pod(name, [worker], node=node, uid=uid, phase="Running", namespace=namespace)
    pod["spec"]["resourceClaims"] = [{"name": e, "resourceClaimName": c} for e, c in zip(entries, claims, strict=True)]
    return pod
