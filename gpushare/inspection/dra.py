"""What ``inspect`` reads of the DRA driver ``gpu.gpushare.io``: the cards the nodes' ResourceSlices offer
and the shares of them that ResourceClaims were allocated. Pure: the objects as the API server lists
them in, plain values out; what can't be read becomes a problem naming the slice or claim, never a
silent gap.

A ResourceSlice is read back with :func:`gpushare.advertiser.resourceslice.offered_cards`, a claim's
allocation with :func:`gpushare.contract.resourceclaim.driver_shares`, the readers the node agent uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.advertiser.resourceslice import (
    OfferedCard,
    ResourceSliceError,
    live_generation,
    live_pool,
    offered_cards,
)
from gpushare.contract.errors import ContractError
from gpushare.contract.resourceclaim import AllocatedShare, driver_shares


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


@dataclass(frozen=True, slots=True)
class DraCards:
    """Per node (the slice's pool), the cards its ResourceSlice offers; the claims' shares of them; and
    the slices and claims that could not be read."""

    offered: Mapping[str, tuple[OfferedCard, ...]]
    shares: tuple[ClaimShare, ...]
    problems: tuple[str, ...] = ()

    def of_node(self, node: str) -> DraCards:
        """Only ``node``'s cards and shares (the problems stay: they can't say which node they concern)."""
        return DraCards(
            offered={node: self.offered[node]} if node in self.offered else {},
            shares=tuple(s for s in self.shares if s.node == node),
            problems=self.problems,
        )


def offered_by_pool(slices: Iterable[Mapping[str, Any]]) -> tuple[dict[str, tuple[OfferedCard, ...]], list[str]]:
    """Each pool's cards, from its slices of the newest generation (the scheduler ignores older ones)."""
    by_pool: dict[str, list[Mapping[str, Any]]] = {}
    for live in slices:
        by_pool.setdefault(live_pool(live), []).append(live)
    offered: dict[str, tuple[OfferedCard, ...]] = {}
    problems = []
    for pool, lives in by_pool.items():
        newest = max(live_generation(live) for live in lives)
        cards: list[OfferedCard] = []
        for live in (live for live in lives if live_generation(live) == newest):
            try:
                cards.extend(offered_cards(live))
            except ResourceSliceError as exc:
                problems.append(f"{exc}; its cards are not shown")
        offered[pool] = tuple(sorted(cards, key=lambda c: c.index))
    return offered, problems


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


def dra_cards(slices: Iterable[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]]) -> DraCards:
    """The driver's slices and the cluster's claims (any driver's: the others are left out) as ``inspect``
    shows them."""
    offered, problems = offered_by_pool(slices)
    shares: list[ClaimShare] = []
    for claim in claims:
        try:
            shares.extend(claim_shares(claim))
        except ContractError as exc:
            problems.append(f"{exc}; the claim is not shown")
    return DraCards(offered=offered, shares=tuple(shares), problems=tuple(problems))
