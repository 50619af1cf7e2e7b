"""Replaying pods onto nodes the way the FGD paper's simulator does (Weng et al., "Beware of
Fragmentation", USENIX ATC'23, and its public kubernetes-scheduler-simulator).

Pods only arrive, nobody leaves: the originals sorted by name and shuffled per seed, then clones drawn
with replacement until the GPU requested reaches ``LOAD`` x the cluster's capacity. One pod at a time:
the nodes where it fits (CPU, memory, card model, GPUs) are handed to a *chooser*, which picks a node
and cards, or the pod is dropped (its request still counts as arrived). The metric is the average
allocation % within each integer arrived-% bucket.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gpushare.placement.batch import able_cards
from gpushare.placement.demand import CardRule
from gpushare.simulate.trace import MILLI_PER_CARD, TraceNode, TracePod

LOAD = 1.3
ARRIVALS = (90, 100, 130)

Choice = tuple[int, tuple[int, ...]]


def affinity_tag(pod: TracePod) -> str:
    """The paper's GPU-affinity class of a pod: no GPU, a share of one card, or k whole cards."""
    if not pod.num_gpu:
        return "no-gpu"
    if pod.num_gpu == 1 and pod.gpu_milli < MILLI_PER_CARD:
        return "share-gpu"
    return f"{pod.num_gpu}-gpu"


@dataclass(slots=True)
class ClusterState:
    """The nodes as arrays: per (node, card) capacity and free milli (capacity 0: no such card) and model,
    per node allocatable and free CPU and memory, per-affinity-class pod counts, and a generation that moves
    on every change (per-node answers are memoised on it)."""

    names: list[str]
    capacity: np.ndarray
    free: np.ndarray
    cpu: np.ndarray
    memory: np.ndarray
    cpu_allocatable: np.ndarray
    memory_allocatable: np.ndarray
    #: per (node, card): its model, as a number into ``models`` (0 where there is no card)
    card_models: np.ndarray
    models: tuple[str, ...]
    tags: dict[str, int]
    affinity: np.ndarray
    generation: np.ndarray
    #: where equal scores are concerned, the node with the lowest rank wins (see ``replay``)
    rank: np.ndarray
    _allowed: dict[frozenset[str], np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, nodes: Sequence[TraceNode], pods: Sequence[TracePod] = ()) -> ClusterState:
        width = max(n.gpus for n in nodes)
        capacity = np.array(
            [[MILLI_PER_CARD] * n.gpus + [0] * (width - n.gpus) for n in nodes], dtype=np.int64
        ).reshape(len(nodes), width)
        tags = {tag: i for i, tag in enumerate(sorted({affinity_tag(p) for p in pods} - {"no-gpu"}))}
        cpu = np.array([n.cpu_milli for n in nodes], dtype=np.int64)
        memory = np.array([n.memory_mib for n in nodes], dtype=np.int64)
        models = sorted({m for n in nodes for m in n.card_models})
        number = {m: i for i, m in enumerate(models)}
        card_models = np.array(
            [[number[m] for m in n.card_models] + [0] * (width - n.gpus) for n in nodes], dtype=np.intp
        ).reshape(len(nodes), width)
        return cls(
            names=[n.name for n in nodes],
            capacity=capacity,
            free=capacity.copy(),
            cpu=cpu.copy(),
            memory=memory.copy(),
            cpu_allocatable=cpu,
            memory_allocatable=memory,
            card_models=card_models,
            models=tuple(models),
            tags=tags,
            affinity=np.zeros((len(nodes), max(len(tags), 1)), dtype=np.int64),
            generation=np.zeros(len(nodes), dtype=np.int64),
            rank=np.arange(len(nodes)),
        )

    @property
    def total_milli(self) -> int:
        return int(self.capacity.sum())

    def allowed(self, pod: TracePod) -> np.ndarray | None:
        """Per (node, card): whether the pod's ``gpu_spec`` accepts the card's model, by the rule the
        extender applies to ``gpushare.io/gpu-model`` (:class:`CardRule`); None when any model will do."""
        if not pod.models:
            return None
        held = self._allowed.get(pod.models)
        if held is None:
            held = self._allowed[pod.models] = CardRule(pod.models).card_mask(self.card_models, self.models)
        return held

    def able(self, pod: TracePod, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Per (node of ``rows``, card): whether one of the pod's cards can go there."""
        allowed = self.allowed(pod)
        return able_cards(self.capacity[rows], self.free[rows], pod.shape, None if allowed is None else allowed[rows])

    def feasible(self, pod: TracePod) -> np.ndarray:
        """Rows where the pod fits: CPU, memory, card model and GPUs."""
        rows = np.flatnonzero((self.cpu >= pod.cpu_milli) & (self.memory >= pod.memory_mib))
        if pod.num_gpu:
            return rows[self.able(pod, rows).sum(axis=1) >= pod.num_gpu]
        return rows

    def place(self, row: int, cards: Sequence[int], pod: TracePod) -> None:
        for card in cards:
            taken = self.capacity[row, card] if pod.gpu_milli >= MILLI_PER_CARD else pod.gpu_milli
            if self.free[row, card] < taken:
                raise ValueError(f"pod {pod.name}: card {card} of node {self.names[row]} has no room")
            self.free[row, card] -= taken
        self.cpu[row] -= pod.cpu_milli
        self.memory[row] -= pod.memory_mib
        tag = affinity_tag(pod)
        if tag in self.tags:
            self.affinity[row, self.tags[tag]] += 1
        self.generation[row] += 1


class Chooser(Protocol):
    def choose(self, state: ClusterState, pod: TracePod, rows: np.ndarray, rng: np.random.Generator) -> Choice:
        """The node (one of ``rows``, never empty) and the card positions the pod takes there."""
        ...


def arrival_order(pods: Sequence[TracePod], seed: int, capacity_milli: int) -> list[TracePod]:
    """Originals sorted by name and shuffled, then clones drawn from them with replacement; like the
    paper's simulator, the clones stop at the first whose per-card share would pass LOAD x capacity."""
    rng = random.Random(seed)
    originals = sorted(pods, key=lambda p: p.name)
    order = list(originals)
    rng.shuffle(order)
    target = LOAD * capacity_milli
    requested = sum(p.gpu_request for p in order)
    while requested < target:
        clone = originals[rng.randrange(len(originals))]
        if requested + clone.gpu_milli > target:
            break
        order.append(clone)
        requested += clone.gpu_request
    return order


def replay(state: ClusterState, order: Sequence[TracePod], chooser: Chooser, seed: int) -> Iterator[tuple[int, float]]:
    """(arrived %, allocated %) after each pod of ``order``, placing them with ``chooser``.

    Like the paper's simulator, which prefixes node names with a random permutation and breaks equal
    scores by the smallest name, the nodes get a random rank per seed that settles ties for the whole run.
    """
    rng = np.random.default_rng(seed)
    state.rank = rng.permutation(len(state.names))
    total = state.total_milli
    requested = allocated = 0
    for pod in order:
        requested += pod.gpu_request
        rows = state.feasible(pod)
        if rows.size:
            row, cards = chooser.choose(state, pod, rows, rng)
            state.place(row, cards, pod)
            allocated += pod.gpu_request
        yield int(np.floor(100 * requested / total + 0.5)), 100 * allocated / total


def best_of(scores: np.ndarray, rows: np.ndarray, state: ClusterState) -> int:
    """The row of ``rows`` with the highest score; among equals, the lowest rank."""
    best = rows[scores == scores.max()]
    return int(best[0] if best.size == 1 else best[np.argmin(state.rank[best])])


def first_free(state: ClusterState, row: int, pod: TracePod) -> tuple[int, ...]:
    """The first ``num_gpu`` cards (by index) that can take one of the pod's cards."""
    able = np.flatnonzero(state.able(pod, np.array([row]))[0])
    return tuple(int(c) for c in able[: pod.num_gpu])


def tightest(state: ClusterState, row: int, pod: TracePod) -> tuple[int, ...]:
    """Best fit: the cards with the least free milli that still take the pod (lowest index first)."""
    able = np.flatnonzero(state.able(pod, np.array([row]))[0])
    ranked = sorted(able.tolist(), key=lambda c: (state.free[row, c], c))
    return tuple(sorted(ranked[: pod.num_gpu]))
