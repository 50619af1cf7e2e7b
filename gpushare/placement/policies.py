"""Placement policies: which card(s) of a node a demand takes, and how good a node is for a pod.

Every policy answers the same two questions, once for one node (plain Python, for the extender) and
once for many nodes as numpy arrays (for trace replay over thousands of nodes):

- *card keys*: for each card that could take a demand, a number; lower is preferred;
- *node cost*: given the node's free units before and after placing the whole pod, a number;
  lower is preferred.

All costs are pure functions of (cards, pod shapes[, workload]), so callers may memoise them per
(node generation, ``shape_key(demands)``, policy name[, workload version]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpushare.placement.fragmentation import (
    Workload,
    batch_deltas,
    batch_fragmentation,
    fragmentation,
    placement_deltas,
)
from gpushare.placement.model import Shape

Ints = Sequence[int]
Pod = tuple[Shape, ...]


class Policy(Protocol):
    name: str
    #: True when a card's key is exactly the node cost of a pod that takes only that card
    keys_are_node_costs: bool

    def card_keys(self, capacity: Ints, free: Ints, candidates: Ints, take: Ints, pod: Pod) -> list[float]:
        """One key per candidate card position (taking ``take[i]`` units from it); lower is preferred."""
        ...

    def node_cost(self, capacity: Ints, before: Ints, after: Ints, pod: Pod) -> float:
        """How bad it is to turn a node's free units ``before`` into ``after``; lower is preferred."""
        ...

    def batch_card_keys(
        self, capacity: np.ndarray, free: np.ndarray, take: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        """``card_keys`` for every card of many nodes: (nodes, cards) arrays in and out."""
        ...

    def batch_node_cost(
        self, capacity: np.ndarray, before: np.ndarray, after: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        """``node_cost`` for many nodes: (nodes, cards) arrays in, (nodes,) out."""
        ...


@dataclass(frozen=True, slots=True)
class HostFit:
    """What a caller knows beyond GPUs (CPU, memory, model): per (node, workload shape), could the node
    host the shape apart from its GPUs, before and after the placement. Only ``fgd`` uses it."""

    before: np.ndarray
    after: np.ndarray


class Binpack:
    """The original gpushare's choice: the card with the least free space that fits; fuller nodes first."""

    name = "binpack"
    keys_are_node_costs = False

    def card_keys(self, capacity: Ints, free: Ints, candidates: Ints, take: Ints, pod: Pod) -> list[float]:
        return [free[p] for p in candidates]

    def node_cost(self, capacity: Ints, before: Ints, after: Ints, pod: Pod) -> float:
        return sum(after)

    def batch_card_keys(
        self, capacity: np.ndarray, free: np.ndarray, take: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        return free.astype(np.float64)

    def batch_node_cost(
        self, capacity: np.ndarray, before: np.ndarray, after: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        return after.sum(axis=1).astype(np.float64)


class Spread:
    """The card with the most free space; emptier nodes first."""

    name = "spread"
    keys_are_node_costs = False

    def card_keys(self, capacity: Ints, free: Ints, candidates: Ints, take: Ints, pod: Pod) -> list[float]:
        return [-free[p] for p in candidates]

    def node_cost(self, capacity: Ints, before: Ints, after: Ints, pod: Pod) -> float:
        return -sum(after)

    def batch_card_keys(
        self, capacity: np.ndarray, free: np.ndarray, take: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        return -free.astype(np.float64)

    def batch_node_cost(
        self, capacity: np.ndarray, before: np.ndarray, after: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        return -after.sum(axis=1).astype(np.float64)


class Fgd:
    """Fragmentation gradient descent: the placement that increases the node's fragmentation least.

    With an empty workload (nothing observed yet) the pod being placed stands in for the typical
    workload: placements that keep room for another pod like it are preferred.
    """

    name = "fgd"
    keys_are_node_costs = True

    def __init__(self, workload: Workload | None = None) -> None:
        self.workload = workload if workload is not None and len(workload) else None

    def _workload(self, pod: Pod, host: HostFit | None = None) -> Workload:
        if self.workload is not None:
            return self.workload
        if host is not None:
            raise ValueError("fgd: host fit describes a workload's shapes, but this policy has no workload")
        return Workload.from_shapes(pod, coverage=1.0)

    def card_keys(self, capacity: Ints, free: Ints, candidates: Ints, take: Ints, pod: Pod) -> list[float]:
        return placement_deltas(free, capacity, self._workload(pod), candidates, take)

    def node_cost(self, capacity: Ints, before: Ints, after: Ints, pod: Pod) -> float:
        workload = self._workload(pod)
        return fragmentation(after, capacity, workload) - fragmentation(before, capacity, workload)

    def batch_card_keys(
        self, capacity: np.ndarray, free: np.ndarray, take: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        workload = self._workload(pod, host)
        if host is None:
            return batch_deltas(free, capacity, workload, take)
        return batch_deltas(free, capacity, workload, take, host.before, host.after)

    def batch_node_cost(
        self, capacity: np.ndarray, before: np.ndarray, after: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        workload = self._workload(pod, host)
        return batch_fragmentation(after, capacity, workload, None if host is None else host.after) - (
            batch_fragmentation(before, capacity, workload, None if host is None else host.before)
        )


POLICIES: dict[str, Policy] = {p.name: p for p in (Binpack(), Spread(), Fgd())}
DEFAULT_POLICY = "fgd"
