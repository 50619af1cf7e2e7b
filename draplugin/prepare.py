"""What preparing a claim on this node gives kubelet: the claim's CDI spec and one device entry per
allocation result. Pure: the claim read from the API server, the node's cards and what the claims
prepared already hold in, a :class:`Prepared` or a
:class:`~gpushare.contract.resourceclaim.ClaimError` out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.draplugin.cdi import cdi_spec

from gpushare.cards import Card
from gpushare.contract.dra import format_claim_cdi_device
from gpushare.contract.resourceclaim import ClaimAllocation, ClaimError, ClaimRef, claim_allocation
from gpushare.contract.units import MIB_BYTES


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One entry of kubelet's answer: the containers of ``request`` get ``cdi_device_id``."""

    request: str
    pool: str
    device: str
    cdi_device_id: str
    share_id: str | None


@dataclass(frozen=True, slots=True)
class Prepared:
    allocation: ClaimAllocation
    spec: dict[str, Any]
    devices: tuple[PreparedDevice, ...]


def check_room(allocation: ClaimAllocation, prepared: Mapping[str, Mapping[str, int]], cards: Sequence[Card]) -> None:
    """ClaimError, naming the claim, the card and the amounts, when what the claim holds on a card and
    what the other claims ``prepared`` on this node hold there (claim UID -> bytes per card UUID) add up
    to more than the card's memory. The scheduler's allocator never allocates past a card's capacity,
    but it allocates from the ResourceSlices as it finds them: the node is the last to see the sum."""
    by_index = {c.index: c for c in cards}
    wanted: dict[int, int] = {}
    for share in allocation.shares:
        wanted[share.index] = wanted.get(share.index, 0) + share.memory_bytes
    for index, amount in sorted(wanted.items()):
        card = by_index[index]
        others = sum(held.get(card.uuid, 0) for uid, held in prepared.items() if uid != allocation.claim.uid)
        if others + amount > card.memory_mib * MIB_BYTES:
            raise ClaimError(
                f"ResourceClaim {allocation.claim}: card {index} ({card.uuid}) can't take its {amount // MIB_BYTES} "
                f"MiB: the claims prepared on this node hold {others // MIB_BYTES} MiB of its {card.memory_mib} MiB"
            )


def prepare_claim(
    claim: dict[str, Any],
    ref: ClaimRef,
    node: str,
    cards: Sequence[Card],
    unit_mib: int,
    prepared: Mapping[str, Mapping[str, int]],
) -> Prepared:
    """The claim's spec and devices, once each share fits its card and the card's total over every
    claim ``prepared`` on this node (see :func:`check_room`) fits too."""
    allocation = claim_allocation(claim, ref, node)
    spec = cdi_spec(allocation, cards, unit_mib)
    check_room(allocation, prepared, cards)
    devices = tuple(
        PreparedDevice(
            request=share.base_request,
            pool=allocation.pool,
            device=share.device,
            cdi_device_id=format_claim_cdi_device(ref.uid, share.base_request),
            share_id=share.share_id,
        )
        for share in allocation.shares
    )
    return Prepared(allocation=allocation, spec=spec, devices=devices)
