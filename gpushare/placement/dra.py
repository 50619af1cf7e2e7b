"""Where kube-scheduler's DRA allocator would put a pod's ResourceClaims on one node, and how tightly that
packs the node's cards: the score the extender's host entry gives DRA pods (kube-scheduler 1.37's
allocator takes the first devices that fit and has no score for fullness, so the node is the only say
the extender has).

The allocator's choice on a node is predicted as it makes it: each request in turn takes the first
``count`` distinct devices, in slice order, with room for its memory (rounded up to the device's
memory unit, as the slice's ``requestPolicy`` makes kube-scheduler consume it); what an earlier
request took is no longer free for the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpushare.placement.batch import batch_scores


@dataclass(frozen=True, slots=True)
class DeviceAsk:
    """One request of a claim for this driver's cards: ``count`` distinct cards with ``memory_bytes`` of
    each (:func:`gpushare.contract.resourceclaim.driver_requests` reads them from a claim)."""

    request: str
    count: int
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class DraCard:
    """One device of a node's ResourceSlice: its memory and what allocated claims consume of it, in bytes."""

    device: str
    capacity: int
    used: int = 0
    #: consumption is rounded up to a multiple of this (the slice's ``requestPolicy``); 1 when it sets none
    unit: int = 1

    def consumed(self, memory: int) -> int:
        return -(-memory // self.unit) * self.unit


@dataclass(frozen=True, slots=True)
class DraFit:
    """The devices the allocator would take on a node (one per device a request takes, in request
    order) and the bytes left free on them afterwards."""

    devices: tuple[str, ...]
    left: int


def predict(cards: Sequence[DraCard], requests: Sequence[DeviceAsk]) -> DraFit | None:
    """The allocator's first fit of ``requests`` on a node's ``cards`` (in slice order), or None when
    one of them finds too few devices with room."""
    free = {card.device: card.capacity - card.used for card in cards}
    taken: list[str] = []
    for request in requests:
        chosen = [c for c in cards if free[c.device] >= c.consumed(request.memory_bytes)][: request.count]
        if len(chosen) < request.count:
            return None
        for card in chosen:
            free[card.device] -= card.consumed(request.memory_bytes)
        taken += [card.device for card in chosen]
    return DraFit(tuple(taken), sum(free[device] for device in dict.fromkeys(taken)))


def dra_scores(fits: Sequence[DraFit | None]) -> np.ndarray:
    """0..10 per node: 10 where the allocator's cards would be left with the least free memory
    (best fit), 0 where the least tight fit leaves the most and where the claims don't fit."""
    costs = np.array([np.inf if fit is None else float(fit.left) for fit in fits], dtype=float)
    return batch_scores(costs)
