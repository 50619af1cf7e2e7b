"""A ResourceClaim's shares of a node's cards: what the DRA kubelet plugin prepares, what a pod
holds through its claims (:func:`gpushare.holdings.dra.dra_held`), and what each claim holds of every node
(:func:`claim_shares`, which the extender and ``inspect`` count).

Pure: the claim as the API server returns it (a plain dict) in, a :class:`ClaimAllocation` (or card
slices in the node's memory unit) or a :class:`ClaimError` naming the claim and field out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.cards import Card
from gpushare.contract.allocation import CardSlice
from gpushare.contract.dra import parse_device_name, parse_memory_bytes
from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.names import DRA_CAPACITY_MEMORY, DRA_DRIVER
from gpushare.contract.units import MIB_BYTES
from gpushare.placement.dra import DeviceAsk


class ClaimError(ContractError):
    """A ResourceClaim this node can't prepare or count; the message names the claim and the field at
    fault."""


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


def _memory(capacity: Mapping[str, Any], where: str) -> int:
    """The ``memory`` of a capacity map (``where`` names the map), in bytes."""
    if DRA_CAPACITY_MEMORY not in capacity:
        raise ClaimError(f"{where}.{DRA_CAPACITY_MEMORY}: missing")
    try:
        return parse_memory_bytes(capacity[DRA_CAPACITY_MEMORY])
    except ContractError as exc:
        raise ClaimError(f"{where}.{DRA_CAPACITY_MEMORY}: {exc}") from None


def _share(raw: Any, where: str) -> AllocatedShare:
    device = _field(raw, "device", where, str)
    try:
        index = parse_device_name(device)
    except ContractError as exc:
        raise ClaimError(f"{where}.device: {exc}") from None
    memory_bytes = _memory(_field(raw, "consumedCapacity", where, dict), f"{where}.consumedCapacity")
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


def node_shares(claim: dict[str, Any], where: str, node: str) -> tuple[AllocatedShare, ...]:
    """The shares of this node's cards (pool ``node``) that ``claim`` was allocated from driver
    ``gpu.gpushare.io``: none when it was allocated only other drivers' devices or another node's.
    ``where`` names the claim in errors."""
    return tuple(share for _, share in driver_shares(claim, where, node))


def claim_allocation(claim: dict[str, Any], ref: ClaimRef, node: str) -> ClaimAllocation:
    """The shares of this node's cards (pool ``node``) that ``claim`` was allocated from driver
    ``gpu.gpushare.io``. The claim must still be the one kubelet asked about (same UID)."""
    where = f"ResourceClaim {ref}"
    uid = (claim.get("metadata") or {}).get("uid") if isinstance(claim, dict) else None
    if uid != ref.uid:
        raise ClaimError(f"{where}: metadata.uid is {quoted(uid)}, the claim was replaced")
    shares = node_shares(claim, where, node)
    if not shares:
        raise ClaimError(
            f"{where}: status.allocation.devices.results has no device of driver {DRA_DRIVER} in pool {node}"
        )
    return ClaimAllocation(claim=ref, pool=node, shares=shares)


def card_slices(allocation: ClaimAllocation, cards: Sequence[Card], unit_mib: int) -> dict[str, tuple[CardSlice, ...]]:
    """The claim's shares as card slices, grouped by request; each share must name a card of this node
    and be a whole number of units no larger than the card."""
    by_index = {c.index: c for c in cards}
    grouped: dict[str, list[CardSlice]] = {}
    for share in allocation.shares:
        grouped.setdefault(share.base_request, []).append(_slice(allocation, share, by_index, unit_mib))
    return {request: tuple(slices) for request, slices in grouped.items()}


def _slice(allocation: ClaimAllocation, share: AllocatedShare, by_index: dict[int, Card], unit_mib: int) -> CardSlice:
    where = f"ResourceClaim {allocation.claim}: request {share.request} device {share.device}"
    card = by_index.get(share.index)
    if card is None:
        raise ClaimError(f"{where}: no card with index {share.index} on this node")
    unit_bytes = unit_mib * MIB_BYTES
    units, rest = divmod(share.memory_bytes, unit_bytes)
    if rest or units == 0:
        raise ClaimError(
            f"{where}: consumedCapacity.memory {share.memory_bytes} bytes is not a whole number of {unit_mib} MiB units"
        )
    if units * unit_mib > card.memory_mib:
        raise ClaimError(
            f"{where}: consumedCapacity.memory {units * unit_mib} MiB exceeds the card's {card.memory_mib} MiB"
        )
    return CardSlice(index=card.index, uuid=card.uuid, units=units)


def asks_driver(claim: Mapping[str, Any]) -> bool:
    """Whether a request of ``claim`` (or one of its ``firstAvailable`` subrequests) names DeviceClass
    ``gpu.gpushare.io``."""
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    asked = (
        alternative.get("deviceClassName")
        for request in requests
        if isinstance(request, dict)
        for alternative in [request.get("exactly") or {}, *(request.get("firstAvailable") or [])]
        if isinstance(alternative, dict)
    )
    return DRA_DRIVER in asked


def driver_requests(claim: Mapping[str, Any], where: str) -> tuple[DeviceAsk, ...]:
    """Each request of ``claim``'s ``spec.devices.requests`` when every one is an ``exactly`` request of
    DeviceClass ``gpu.gpushare.io`` for ``capacity.requests.memory`` of a count of cards, without
    selectors; else a :class:`ClaimError` naming the claim (``where``) and the field it can't read."""
    devices = _field(claim.get("spec"), "devices", f"{where}: spec", dict)
    requests = _field(devices, "requests", f"{where}: spec.devices", list)
    return tuple(_device_ask(raw, f"{where}: spec.devices.requests[{i}]") for i, raw in enumerate(requests))


def _device_ask(raw: Any, where: str) -> DeviceAsk:
    if isinstance(raw, dict) and "exactly" not in raw:
        raise ClaimError(f"{where}: not an exactly request ({', '.join(sorted(raw)) or 'empty'})")
    exactly = _field(raw, "exactly", where, dict)
    at = f"{where}.exactly"
    if (cls := _field(exactly, "deviceClassName", at, str)) != DRA_DRIVER:
        raise ClaimError(f"{at}.deviceClassName: {quoted(cls)} is not {DRA_DRIVER}")
    if (mode := exactly.get("allocationMode", "ExactCount")) != "ExactCount":
        raise ClaimError(f"{at}.allocationMode: {quoted(mode)} is not ExactCount")
    if exactly.get("selectors"):
        raise ClaimError(f"{at}.selectors: a request with selectors can't be predicted")
    count = exactly.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ClaimError(f"{at}.count: {quoted(count)} is not a positive whole number")
    requested = _field(_field(exactly, "capacity", at, dict), "requests", f"{at}.capacity", dict)
    return DeviceAsk(_field(raw, "name", where, str), count, _memory(requested, f"{at}.capacity.requests"))


@dataclass(frozen=True, slots=True)
class ClaimShare:
    """What one ResourceClaim holds of one device of a node: ``memory_bytes`` (its allocation results
    there, summed), and who uses the claim (``status.reservedFor``, as ``pod/<name>``)."""

    namespace: str
    name: str
    users: tuple[str, ...]
    node: str
    device: str
    index: int
    memory_bytes: int

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _users(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """``status.reservedFor`` as ``pod/<name>`` (other consumers as ``<resource>/<name>``)."""
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    kinds = {"pods": "pod"}
    users = (f"{kinds.get(r.get('resource'), r.get('resource') or '?')}/{r.get('name') or '?'}" for r in reserved)
    return tuple(sorted(users))


def claim_shares(claim: Mapping[str, Any]) -> list[ClaimShare]:
    """The claim's shares of the driver's devices, one per device (its results there summed); [] while
    it is not allocated."""
    meta = claim.get("metadata") or {}
    namespace, name = meta.get("namespace", "?"), meta.get("name", "?")
    if not (claim.get("status") or {}).get("allocation"):
        return []
    held: dict[tuple[str, str], list[AllocatedShare]] = {}
    for pool, share in driver_shares(claim, f"ResourceClaim {namespace}/{name}"):
        held.setdefault((pool, share.device), []).append(share)
    users = _users(claim)
    return [
        ClaimShare(namespace, name, users, pool, device, shares[0].index, sum(s.memory_bytes for s in shares))
        for (pool, device), shares in held.items()
    ]
