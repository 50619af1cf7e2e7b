"""How a pod fits on a node: the placement of a pod whose init containers request GPUs, by Kubernetes'
rule for init containers (how filter chooses to decide it is :mod:`gpushare.extender.filterway`'s).

Init containers run one at a time and end before the app containers start, so a pod needs the larger
of its app containers' sum and its largest init container. Here the app containers are placed
together and each init container on its own, all on the node's cards as they are before the pod:
whatever each of them takes fits in a card's free units, so their largest does too, and that largest
is what :func:`gpushare.holdings.pod.held_units` then counts the pod for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpushare import placement


@dataclass(frozen=True, slots=True)
class InitOrder:
    """A pod's GPU demands (in spec order), and the groups Kubernetes runs them in: its app containers
    together (if it has any), then every init container alone. ``key``: the groups' shapes, the same
    for two pods that fit, and cost, the same on any node. Every question takes the pod's card rule,
    with no default: one left out would place the pod on models or links it refused."""

    demands: tuple[placement.Demand, ...]
    groups: tuple[tuple[placement.Demand, ...], ...]
    key: tuple[tuple[placement.Shape, ...], ...]

    @classmethod
    def of(cls, demands: Sequence[placement.Demand], init: frozenset[str]) -> InitOrder:
        apps = tuple(d for d in demands if d.container not in init)
        groups = ((apps,) if apps else ()) + tuple((d,) for d in demands if d.container in init)
        return cls(tuple(demands), groups, tuple(placement.shape_key(group) for group in groups))

    def fit(
        self, cards: Sequence[placement.CardCapacity], unit: str, rule: placement.CardRule
    ) -> placement.NoFit | None:
        for group in self.groups:
            nofit = placement.check_fit(cards, group, unit=unit, rule=rule)
            if nofit is not None:
                return nofit
        return None

    def cost(
        self, cards: Sequence[placement.CardCapacity], policy: placement.Policy, unit: str, rule: placement.CardRule
    ) -> float:
        """The policy's cost of what the pod keeps: its app containers (its init containers when it has
        no GPU app container); raises NoFit when any part doesn't fit."""
        if len(self.groups) > 1 and (nofit := self.fit(cards, unit, rule)) is not None:
            raise nofit  # one group alone: costing it says whether it fits
        return placement.node_cost(cards, self.groups[0], policy, unit=unit, rule=rule)

    def place(
        self, cards: Sequence[placement.CardCapacity], policy: placement.Policy, unit: str, rule: placement.CardRule
    ) -> tuple[placement.Assignment, ...]:
        """Assignments for every demand; raises NoFit. The rule binds each group on its own: the app
        containers' cards together, and each init container's."""
        return tuple(a for group in self.groups for a in placement.place(cards, group, policy, unit=unit, rule=rule))


def original_plugin_refusal(demands: Sequence[placement.Demand]) -> str | None:
    """Why a node that still runs the original device plugin can't serve this pod, or None.

    That plugin matches each Allocate to a pod by the pod's whole gpu-mem and gives every container
    the one card the pod was annotated with, so it serves exactly one gpu-mem container on one card.
    """
    if len(demands) == 1 and not demands[0].exclusive and demands[0].cards == 1:
        return None
    return (
        "runs the original gpushare device plugin (its cards are inferred from its status), which serves "
        "only pods with a single gpu-mem container on one card"
    )
