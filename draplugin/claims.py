"""What the node must prepare for a ResourceClaim: the shares of its cards the claim was allocated.

Pure: the claim as the API server returns it (a plain dict) in, a :class:`ClaimAllocation` or a
:class:`ClaimError` naming the claim and field out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.dra import parse_device_name, parse_memory_bytes
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


def _share(raw: Any, where: str) -> AllocatedShare:
    device = _field(raw, "device", where, str)
    try:
        index = parse_device_name(device)
    except ContractError as exc:
        raise ClaimError(f"{where}.device: {exc}") from None
    consumed = _field(raw, "consumedCapacity", where, dict)
    if DRA_CAPACITY_MEMORY not in consumed:
        raise ClaimError(f"{where}.consumedCapacity.{DRA_CAPACITY_MEMORY}: missing")
    try:
        memory_bytes = parse_memory_bytes(consumed[DRA_CAPACITY_MEMORY])
    except ContractError as exc:
        raise ClaimError(f"{where}.consumedCapacity.{DRA_CAPACITY_MEMORY}: {exc}") from None
    share_id = _field(raw, "shareID", where, str, required=False)
    return AllocatedShare(
        request=_field(raw, "request", where, str),
        device=device,
        index=index,
        memory_bytes=memory_bytes,
        share_id=share_id,
    )


def driver_shares(claim: Mapping[str, Any], where: str, pool: str | None = None) -> list[tuple[str, AllocatedShare]]:
    """Each allocation result of driver ``gpu.gpushare.io`` in ``claim``'s ``status.allocation`` (only
    those in ``pool`` when given), with its pool: the node whose card it is. ``where`` names the claim
    in a :class:`ClaimError`."""
    allocation = _field(claim.get("status"), "allocation", f"{where}: status", dict)
    devices = _field(allocation, "devices", f"{where}: status.allocation", dict)
    results = _field(devices, "results", f"{where}: status.allocation.devices", list)
    shares = []
    for i, raw in enumerate(results):
        at = f"{where}: status.allocation.devices.results[{i}]"
        if _field(raw, "driver", at, str) != DRA_DRIVER:
            continue
        in_pool = _field(raw, "pool", at, str)
        if pool is None or in_pool == pool:
            shares.append((in_pool, _share(raw, at)))
    return shares


def claim_allocation(claim: dict[str, Any], ref: ClaimRef, node: str) -> ClaimAllocation:
    """The shares of this node's cards (pool ``node``) that ``claim`` was allocated from driver
    ``gpu.gpushare.io``. The claim must still be the one kubelet asked about (same UID)."""
    where = f"ResourceClaim {ref}"
    uid = (claim.get("metadata") or {}).get("uid") if isinstance(claim, dict) else None
    if uid != ref.uid:
        raise ClaimError(f"{where}: metadata.uid is {quoted(uid)}, the claim was replaced")
    shares = [share for _, share in driver_shares(claim, where, node)]
    if not shares:
        raise ClaimError(
            f"{where}: status.allocation.devices.results has no device of driver {DRA_DRIVER} in pool {node}"
        )
    return ClaimAllocation(claim=ref, pool=node, shares=tuple(shares))
