"""ResourceClaims as the API server returns them, and the node's cards, for the DRA plugin's tests."""

from __future__ import annotations

from typing import Any

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


def claim(*results: dict[str, Any], uid: str = REF.uid) -> dict[str, Any]:
    return {
        "metadata": {"namespace": REF.namespace, "name": REF.name, "uid": uid},
        "status": {"allocation": {"devices": {"results": list(results or (result(),))}}},
    }
