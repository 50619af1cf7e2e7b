"""Who decides a container's cards, and who only checks them.

**The extender decides** (:mod:`gpushare.placement`, in filter and bind) and records the decision on
the pod (``gpushare.io/allocation``) and in the node's ledger. Nothing on the node decides again:
kubelet's device plugin API makes **Allocate** answer with some device IDs, and **CreateContainer**
(the NRI plugin or the CRI shim) sees the container that answer made; both only check the extender's
decision against the node with :func:`check_extender_decision`, and refuse, or put the decided cards
back in place of what kubelet handed out. That is the one check both apply, and the one way either
refuses.

Whoever wrote the assignment, nothing here trusts it: every assigned card must be on this node under
the index the assignment gives and within what the extender recorded for the pod in the node's ledger
(when it has an entry), and the units the node's live pods hold on it must fit its capacity.
Pure: plain values in, a :class:`Refusal` or None out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpushare.cards import Card
from gpushare.contract.allocation import CardSlice
from gpushare.contract.errors import LedgerMismatch
from gpushare.contract.names import NODE_ANN_PENDING_BINDS
from gpushare.contract.pending import Ledger
from gpushare.contract.units import MemoryUnit
from gpushare.holdings.pod import PodCards, describe_held
from gpushare.placement.demand import ANY_CARD, CardCapacity, CardRule


class Refusal(Exception):
    """A container must not get its cards.

    ``reason`` is a short label for metrics; ``invalid_input`` marks bad annotations (as opposed to a
    node state that forbids the assignment); ``pod`` is the pod the refusal is about, when known. The
    device plugin raises it; the CRI shim passes it along as a value.
    """

    def __init__(
        self, reason: str, message: str, *, invalid_input: bool = False, pod: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.invalid_input = invalid_input
        self.pod = pod

    @property
    def message(self) -> str:
        return str(self)

    def about(self, pod: Mapping[str, Any]) -> Refusal:
        """The same refusal, naming the pod it is about."""
        return Refusal(self.reason, self.message, invalid_input=self.invalid_input, pod=pod)


@dataclass(frozen=True, slots=True)
class Claim:
    """One container's assigned cards, as the node is asked to honour them."""

    pod: str  # namespace/name
    uid: str
    container: str
    slices: tuple[CardSlice, ...]
    #: the container asked for whole cards (gpu-count alone), so each slice must be a whole card
    exclusive: bool = False
    #: what the pod's annotations ask of its cards (model, NVLink, NUMA, memory limits)
    rule: CardRule = ANY_CARD

    def __str__(self) -> str:
        return f"pod {self.pod} container {self.container}"


@dataclass(frozen=True, slots=True)
class Holdings:
    """What the node's live pods hold: units per card UUID and the pods counted (see
    :func:`gpushare.holdings.node.node_usage`), and the node's ledger they were counted with."""

    used: Mapping[str, int]
    pods: Sequence[PodCards]
    ledger: Ledger = field(default_factory=dict)

    def held_by(self, claim: Claim) -> Mapping[str, int] | None:
        """What ``claim``'s pod holds per card UUID, when it is among the pods counted (by uid when known,
        else by name); else None."""
        return next((p.held for p in self.pods if (p.uid == claim.uid if claim.uid else p.key == claim.pod)), None)

    def holds(self, claim: Claim) -> bool:
        """Whether ``claim``'s pod is among the pods counted."""
        return self.held_by(claim) is not None


def describe(slices: Sequence[CardSlice]) -> str:
    """``card 0 (GPU-…), card 1 (GPU-…)``: how logs and messages name a container's cards."""
    return ", ".join(f"card {s.index} ({s.uuid})" for s in slices)


def check_extender_decision(
    claim: Claim,
    cards: Sequence[Card],
    unit: MemoryUnit,
    holdings: Holdings | None,
    *,
    require_healthy: bool = True,
) -> Refusal | None:
    """Why ``claim`` can't be honoured on a node with ``cards``, or None when it can. Besides the cards
    existing (healthy, and whole where asked whole), their models, topology and memory limits must meet
    the claim's card rule (among the container's own cards: other containers' cards are checked with theirs).

    ``holdings``: what the node's live pods hold; when the claim's pod isn't among them yet, its
    slices are added on top. None skips the over-commit check (the caller has no view of the node's
    pods). ``require_healthy``: a new allocation must land on healthy cards; the CRI shim passes
    False, because a container re-created in a pod that already holds its cards keeps them, as
    kubelet keeps a running pod's devices when they turn unhealthy.
    """
    by_uuid = {c.uuid: c for c in cards}
    for s in claim.slices:
        card = by_uuid.get(s.uuid)
        if card is None:
            return Refusal("unknown-card", f"{claim}: assigned card {s.index} ({s.uuid}) is not on this node")
        if card.index != s.index:
            return Refusal(
                "unknown-card",
                f"{claim}: assigned card {s.uuid} is index {card.index} here, not {s.index} as annotated",
            )
        if require_healthy and not card.healthy:
            return Refusal("unhealthy-card", f"{claim}: assigned card {s.index} ({s.uuid}) is unhealthy")
        if claim.exclusive and s.units != unit.units_of(card.memory_mib):
            return Refusal(
                "bad-annotation",
                f"{claim}: requests card {s.index} ({s.uuid}) whole but is assigned {s.units} of its "
                f"{unit.units_of(card.memory_mib)} unit(s)",
                invalid_input=True,
            )
    assigned = [by_uuid[s.uuid] for s in claim.slices]
    violation = claim.rule.violation([CardCapacity.of(c) for c in assigned])
    if violation is not None:
        return Refusal("card-rule", f"{claim}: {violation}")
    if holdings is None:
        return None
    recorded = holdings.ledger.get(claim.uid) if claim.uid else None
    if recorded is not None and (off := [s for s in claim.slices if recorded.held.get(s.uuid, 0) < s.units]):
        claimed = ", ".join(f"card {s.index} ({s.uuid}) {s.units} unit(s)" for s in off)
        mismatch = LedgerMismatch(claim.pod, NODE_ANN_PENDING_BINDS, claimed, describe_held(recorded.held, cards))
        return Refusal("ledger-mismatch", f"{claim}: {mismatch}", invalid_input=True)
    pending = not holdings.holds(claim)
    for s in claim.slices:
        capacity = unit.units_of(by_uuid[s.uuid].memory_mib)
        claimed = holdings.used.get(s.uuid, 0) + (s.units if pending else 0)
        if claimed > capacity:
            holders = sorted((p.key, p.held.get(s.uuid, 0)) for p in holdings.pods)
            if pending:
                holders.append((claim.pod, s.units))
            named = ", ".join(f"{key} ({units})" for key, units in holders if units)
            return Refusal(
                "overcommit",
                f"{claim}: card {s.index} ({s.uuid}) would be over-committed: live pods on this node claim "
                f"{claimed} of its {capacity} {unit.name} unit(s): {named}",
            )
    return None
