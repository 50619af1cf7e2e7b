"""What ``inspect`` reads of the DRA driver ``gpu.gpushare.io``: the cards the nodes' ResourceSlices offer
and the shares of them that ResourceClaims were allocated. Pure: the objects as the API server lists
them in, plain values out; what can't be read becomes a problem naming the slice or claim, never a
silent gap.

A node's ResourceSlices are read back with :func:`gpushare.contract.resourceslice.offered_by_pool`, a
claim's shares with :func:`gpushare.contract.resourceclaim.claim_shares`, the readers the extender uses
too (over :func:`~gpushare.contract.resourceslice.offered_cards` and
:func:`~gpushare.contract.resourceclaim.driver_shares`, the node agent's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.errors import ContractError
from gpushare.contract.resourceclaim import ClaimShare, claim_shares
from gpushare.contract.resourceslice import OfferedCard, offered_by_pool


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
