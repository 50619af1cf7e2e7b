"""What preparing a claim on this node gives kubelet: the claim's CDI spec and one device entry per
allocation result. Pure: the claim read from the API server and the node's cards in, a
:class:`Prepared` or a :class:`~gpushare.contract.resourceclaim.ClaimError` out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.draplugin.cdi import cdi_device_id, cdi_spec

from gpushare.cards import Card
from gpushare.contract.resourceclaim import ClaimAllocation, ClaimRef, claim_allocation


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


def prepare_claim(claim: dict[str, Any], ref: ClaimRef, node: str, cards: Sequence[Card], unit_mib: int) -> Prepared:
    allocation = claim_allocation(claim, ref, node)
    spec = cdi_spec(allocation, cards, unit_mib)
    devices = tuple(
        PreparedDevice(
            request=share.base_request,
            pool=allocation.pool,
            device=share.device,
            cdi_device_id=cdi_device_id(ref.uid, share.base_request),
            share_id=share.share_id,
        )
        for share in allocation.shares
    )
    return Prepared(allocation=allocation, spec=spec, devices=devices)
