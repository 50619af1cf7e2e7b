"""What the node must prepare for a ResourceClaim: the shares of its cards the claim was allocated.

Pure: the claim as the API server returns it (a plain dict) in, a :class:`ClaimAllocation` or a
:class:`ClaimError` naming the claim and field out.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from gpushare.contract.dra import parse_device_name
from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.names import DRA_CAPACITY_MEMORY, DRA_DRIVER


class ClaimError(ContractError):
    """A ResourceClaim this node can't prepare; the message names the claim and the field at fault."""


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as kubelet names it in NodePrepareResources and NodeUnprepareResources."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True, slots=True)
class AllocatedShare:
    """One allocation result of this driver on this node: ``memory_bytes`` of card ``index``."""

    request: str
    device: str
    index: int
    memory_bytes: int
    share_id: str | None

    @property
    def base_request(self) -> str:
        """The claim's request the result belongs to (without a ``firstAvailable`` subrequest), which
        is what a container's ``resources.claims[].request`` names."""
        return self.request.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class ClaimAllocation:
    claim: ClaimRef
    pool: str
    shares: tuple[AllocatedShare, ...]


def _field(obj: Any, key: str, where: str, kind: type, required: bool = True) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    if value is None and not required:
        return None
    if not isinstance(value, kind) or (kind is str and not value):
        expected = {str: "a non-empty string", dict: "an object", list: "a list"}[kind]
        raise ClaimError(f"{where}.{key}: {quoted(value)} is not {expected}")
    return value


def _memory_bytes(raw: Any, where: str) -> int:
    try:
        amount = parse_quantity(raw) if isinstance(raw, str | int) and not isinstance(raw, bool) else None
    except ValueError:
        amount = None
    if amount is None or amount != amount.to_integral_value() or amount <= 0:
        raise ClaimError(f"{where}: {quoted(raw)} is not a positive whole number of bytes")
    return int(Decimal(amount))


def _share(raw: Any, where: str) -> AllocatedShare:
    device = _field(raw, "device", where, str)
    try:
        index = parse_device_name(device)
    except ContractError as exc:
        raise ClaimError(f"{where}.device: {exc}") from None
    consumed = _field(raw, "consumedCapacity", where, dict)
    if DRA_CAPACITY_MEMORY not in consumed:
        raise ClaimError(f"{where}.consumedCapacity.{DRA_CAPACITY_MEMORY}: missing")
    share_id = _field(raw, "shareID", where, str, required=False)
    return AllocatedShare(
        request=_field(raw, "request", where, str),
        device=device,
        index=index,
        memory_bytes=_memory_bytes(consumed[DRA_CAPACITY_MEMORY], f"{where}.consumedCapacity.{DRA_CAPACITY_MEMORY}"),
        share_id=share_id,
    )


def claim_allocation(claim: dict[str, Any], ref: ClaimRef, node: str) -> ClaimAllocation:
    """The shares of this node's cards (pool ``node``) that ``claim`` was allocated from driver
    ``gpu.gpushare.io``. The claim must still be the one kubelet asked about (same UID)."""
    where = f"ResourceClaim {ref}"
    uid = (claim.get("metadata") or {}).get("uid") if isinstance(claim, dict) else None
    if uid != ref.uid:
        raise ClaimError(f"{where}: metadata.uid is {quoted(uid)}, the claim was replaced")
    allocation = _field(claim.get("status"), "allocation", f"{where}: status", dict)
    devices = _field(allocation, "devices", f"{where}: status.allocation", dict)
    results = _field(devices, "results", f"{where}: status.allocation.devices", list)
    shares = []
    for i, raw in enumerate(results):
        at = f"{where}: status.allocation.devices.results[{i}]"
        if _field(raw, "driver", at, str) != DRA_DRIVER or _field(raw, "pool", at, str) != node:
            continue
        shares.append(_share(raw, at))
    if not shares:
        raise ClaimError(
            f"{where}: status.allocation.devices.results has no device of driver {DRA_DRIVER} in pool {node}"
        )
    return ClaimAllocation(claim=ref, pool=node, shares=tuple(shares))
