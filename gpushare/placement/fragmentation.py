"""Fragmentation maths in the spirit of FGD (Weng et al., "Beware of Fragmentation", USENIX ATC'23).

A node's fragmentation for one typical shape is the idle GPU capacity that shape can't use: all of the
node's idle units when the shape can't be placed there at all, otherwise the idle units on cards whose
free space is below what the shape needs per card (a shape that needs no GPU can use none of them, so
to it all idle units are fragments). The node's fragmentation is the frequency-weighted sum over the
workload's typical shapes. Placing a demand on a card changes it by a *delta*; FGD picks
the placement with the smallest delta. One vectorised implementation, over (nodes, cards) arrays,
serves one node (the extender's per-node path) and thousands (prioritize, trace replay).

``host_ok`` lets a caller that knows more than the GPUs (CPU, memory, model constraints) say per
shape whether the node could host it apart from its GPUs; without it only GPUs count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from gpushare.placement.demand import CardRule, Shape

#: threshold for an absent card: nothing fits on it
_NEVER = 1 << 62

K = TypeVar("K", bound=Hashable)


def most_common(observed: Iterable[K], coverage: float = 0.95, step: int = 1) -> list[tuple[K, int]]:
    """The most frequent keys, with their counts, that together cover ``coverage`` of ``observed``,
    taken ``step`` keys at a time.

    Equally frequent keys go in descending natural order (keys must be orderable), as the FGD
    paper's simulator sorts them, so the result never depends on the order of ``observed``.
    """
    counts = Counter(observed)
    ranked = sorted(counts.items(), key=lambda item: (item[1], item[0]), reverse=True)
    target = coverage * sum(counts.values())
    size = 0
    while size < len(ranked) and sum(n for _, n in ranked[:size]) < target:
        size += step
    return ranked[:size]


@dataclass(frozen=True, slots=True)
class Workload:
    """Typical shapes with how often each was seen.

    Fragmentation is computed as an exact integer sum weighted by ``counts`` and divided by their total
    once, so that equal placements cost exactly the same and ties stay ties.
    """

    shapes: tuple[Shape, ...]
    counts: tuple[int, ...]
    #: per shape, what a pod of it needs of the node besides GPUs: (CPU milli, memory); empty when unknown
    hosts: tuple[tuple[int, int], ...] = ()
    #: per shape, the card models its pods accept; empty when unknown (any model)
    rules: tuple[CardRule, ...] = ()

    @classmethod
    def from_shapes(cls, observed: Iterable[Shape], coverage: float = 0.95) -> Workload:
        """The typical shapes among ``observed`` demand shapes (see ``most_common``); with nothing
        observed, an empty workload."""
        kept = most_common(observed, coverage)
        return cls(tuple(s for s, _ in kept), tuple(n for _, n in kept))

    @classmethod
    def from_pods(cls, observed: Iterable[tuple[Shape, int, int, CardRule]], coverage: float = 0.95) -> Workload:
        """The typical (GPU shape, CPU milli, memory, card rule) of the GPU pods among ``observed``, so that
        a node whose CPU or memory ran out, or whose cards a shape's pods don't accept, counts its idle
        GPUs as fragments for that shape. Only a rule's models count (not its topology)."""
        rules: dict[tuple[tuple[str, ...], tuple[str, ...]], CardRule] = {}

        def key(pod: tuple[Shape, int, int, CardRule]) -> tuple[Shape, int, int, tuple[tuple[str, ...], ...]]:
            shape, cpu, memory, rule = pod
            named = (tuple(sorted(rule.models)), tuple(sorted(rule.avoid)))
            rules.setdefault(named, rule.models_only())
            return shape, cpu, memory, named

        kept = most_common(map(key, observed), coverage)
        return cls(
            tuple(s for (s, _, _, _), _ in kept),
            tuple(n for _, n in kept),
            tuple((c, m) for (_, c, m, _), _ in kept),
            tuple(rules[r] for (_, _, _, r), _ in kept),
        )

    def access(self, card_models: np.ndarray, models: Sequence[str], capacity: np.ndarray) -> np.ndarray | None:
        """Per (node, shape): whether the node has a card whose model the shape's pods accept;
        ``card_models`` numbers each (node, card)'s model in ``models``. None when every shape takes any
        model."""
        if not any(rule.picks_models for rule in self.rules):
            return None
        real = capacity > 0
        out = np.ones((len(card_models), len(self)), dtype=bool)
        for column, rule in enumerate(self.rules):
            if rule.picks_models:
                out[:, column] = (rule.card_mask(card_models, models) & real).any(axis=1)
        return out

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def stranded(self, idle: np.ndarray, card: np.ndarray, cpu: np.ndarray, memory: np.ndarray) -> np.ndarray:
        """Idle GPU units that the free ``cpu`` and ``memory`` beside them can't feed, at the rate the
        workload's GPU pods consume CPU and memory per GPU unit.

        ``idle`` is (nodes,) or (nodes, k); ``card`` (the units of one of the node's cards), ``cpu`` and
        ``memory`` are (nodes,). A whole card counts as ``card`` units on each node, a share as its own
        units. Zero when the workload says nothing about CPU and memory.
        """
        if not self.hosts:
            return np.zeros(idle.shape)
        whole = shared = cpu_need = memory_need = 0
        for shape, count, (shape_cpu, shape_memory) in zip(self.shapes, self.counts, self.hosts, strict=True):
            if shape.cards:
                if shape.exclusive:
                    whole += count * shape.cards
                else:
                    shared += count * shape.cards * shape.units
                cpu_need += count * shape_cpu
                memory_need += count * shape_memory
        # GPU units the workload's pods take on each node, against the CPU and memory they take with them
        gpu = card * whole + shared
        fed = np.full(len(card), np.inf)
        for free, need in ((cpu, cpu_need), (memory, memory_need)):
            if need > 0:
                fed = np.minimum(fed, np.maximum(free, 0) * gpu / need)
        if idle.ndim == 2:
            fed = fed[:, None]
        return np.maximum(idle - fed, 0)


class _BatchShapes:
    """The workload as arrays for a cluster's capacities.

    Shapes that differ only in what ``host_ok`` covers share their GPU maths: per node, each distinct
    GPU shape is weighted by the counts of the shapes the node can host apart from its GPUs.
    """

    def __init__(self, workload: Workload, capacity: np.ndarray) -> None:
        distinct = sorted(set(workload.shapes))
        column = {shape: i for i, shape in enumerate(distinct)}
        self.members = np.zeros((len(workload), len(distinct)), dtype=np.int64)
        for row, (shape, count) in enumerate(zip(workload.shapes, workload.counts, strict=True)):
            self.members[row, column[shape]] = count
        self.total = workload.total
        self.cards = np.array([s.cards for s in distinct], dtype=np.int64)
        units = np.array([s.units for s in distinct], dtype=np.int64)
        exclusive = np.array([s.exclusive for s in distinct], dtype=bool)
        cap3 = capacity[:, :, None]
        usable = (cap3 > 0) & (self.cards > 0)
        self.thresholds = np.where(usable, np.where(exclusive, cap3, units), _NEVER)

    def weights(self, host_ok: np.ndarray | None) -> np.ndarray:
        """(nodes, distinct shapes) counts of the shapes each node could host apart from its GPUs."""
        if host_ok is None:
            return self.members.sum(axis=0)[None, :]
        return host_ok.astype(np.int64) @ self.members

    def stats(self, free: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per (node, card, shape): can host, stranded units; per (node, shape): hosts, stranded units."""
        free3 = free[:, :, None]
        hosting = free3 >= self.thresholds
        stranded = np.where(hosting, 0, free3)
        return hosting, stranded, hosting.sum(axis=1), stranded.sum(axis=1)


# Both functions below compute fragmentation x workload total as
#   sum over shapes of weight * (stranded - idle if the GPUs fit the shape else 0)  +  total * idle
# which is the definition rearranged so that shapes the node can't host drop out of the GPU maths.


def fragmentation(
    free: np.ndarray, capacity: np.ndarray, workload: Workload, host_ok: np.ndarray | None = None
) -> np.ndarray:
    """Fragmentation of each node whose cards have ``free`` of ``capacity`` units: (nodes, cards) arrays
    in (absent cards: capacity 0, unhealthy ones: 0 free), (nodes,) out; ``host_ok`` is (nodes, shapes).
    """
    shapes = _BatchShapes(workload, capacity)
    _, _, hosts, stranded = shapes.stats(free)
    idle = free.sum(axis=1)
    gain = np.where(hosts >= shapes.cards, stranded - idle[:, None], 0)
    return ((shapes.weights(host_ok) * gain).sum(axis=1) + shapes.total * idle) / shapes.total


def placement_deltas(
    free: np.ndarray,
    capacity: np.ndarray,
    workload: Workload,
    take: np.ndarray,
    host_before: np.ndarray | None = None,
    host_after: np.ndarray | None = None,
) -> np.ndarray:
    """Change in each node's fragmentation if ``take`` units were taken from each one of its cards.

    Linear in cards x shapes: each shape's host count and stranded units are computed once per node,
    then adjusted for the one card that changes. ``free``, ``capacity`` and ``take`` are (nodes, cards)
    arrays (absent cards: capacity 0); ``host_before``/``host_after`` are (nodes, shapes) booleans saying
    whether each node could host each shape apart from its GPUs before and after the placement.
    Returns (nodes, cards) deltas.
    """
    shapes = _BatchShapes(workload, capacity)
    hosting, stranded_cards, hosts, stranded = shapes.stats(free)
    idle = free.sum(axis=1)
    before = (shapes.weights(host_before) * np.where(hosts >= shapes.cards, stranded - idle[:, None], 0)).sum(axis=1)

    rest3 = (free - take)[:, :, None]
    hosting_after = rest3 >= shapes.thresholds
    hosts_after = hosts[:, None, :] - hosting + hosting_after
    stranded_after = stranded[:, None, :] - stranded_cards + np.where(hosting_after, 0, rest3)
    idle_after = (idle[:, None] - take)[:, :, None]
    gain_after = np.where(hosts_after >= shapes.cards, stranded_after - idle_after, 0)
    after = np.einsum("ncs,ns->nc", gain_after, np.broadcast_to(shapes.weights(host_after), hosts.shape))
    return (after - before[:, None] - shapes.total * take) / shapes.total
