"""The FGD paper's six scheduling policies, as its public simulator (hkust-adsl/kubernetes-scheduler-simulator)
scores nodes and picks cards. Reference implementations for the benchmark, not product policies.

Every policy but Random gives each node where the pod fits an integer score 0..100 (the simulator's
kube-scheduler framework scores); the highest wins and equal scores are chosen among at random. The
integer truncation matters: it decides which nodes tie, and ties go to the node first in a per-seed
random order (see ``replay``). Card choice inside the node: the first cards by
index for whole-card pods under every policy; for a share of one card, a random fitting card (Random),
the card with the best quantised score, first by index (FGD), else the tightest fitting card.

Scores depend only on the node's state and the pod's (CPU, GPU share, GPU count), so they are memoised
per node generation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpushare.placement.demand import CardRule
from gpushare.placement.memo import RowMemo
from gpushare.simulate.replay import Choice, ClusterState, affinity_tag, best_of, first_free, tightest
from gpushare.simulate.trace import MILLI_PER_CARD, TracePod, parse_models

#: the simulator's normalisers: the largest node's CPU (milli) and GPU (milli)
MAX_CPU = 128_000
MAX_GPU = 8_000
MAX_SCORE = 100
#: typical pods: the most frequent shapes covering this share of all pods, CPU-only pods included
TYPICAL_COVERAGE = 95


def _trunc(values: np.ndarray) -> np.ndarray:
    """Go's float-to-int conversion: towards zero."""
    return np.trunc(values).astype(np.int64)


def _go_div(a: np.ndarray, b: int) -> np.ndarray:
    """Go's integer division: towards zero."""
    return np.sign(a) * (np.abs(a) // b)


class Scored:
    """A policy that scores nodes; subclasses give ``scores`` (for some rows) and ``cards`` (for one)."""

    name = ""

    def __init__(self) -> None:
        self._memos: dict[tuple[int, int, int], RowMemo] = {}

    def scores(self, state: ClusterState, rows: np.ndarray, pod: TracePod) -> np.ndarray:
        raise NotImplementedError

    def cards(self, state: ClusterState, row: int, pod: TracePod, rng: np.random.Generator) -> tuple[int, ...]:
        return tightest(state, row, pod)

    def choose(self, state: ClusterState, pod: TracePod, rows: np.ndarray, rng: np.random.Generator) -> Choice:
        key = (pod.cpu_milli, pod.gpu_milli, pod.num_gpu)
        memo = self._memos.get(key)
        if memo is None:
            memo = self._memos[key] = RowMemo(-np.inf)
        every = memo.values(state.generation, lambda stale: self.scores(state, stale, pod))
        row = best_of(every[rows], rows, state)
        return row, self.cards(state, row, pod, rng)


class RandomPolicy:
    """A node chosen uniformly among those where the pod fits; a random fitting card for a share."""

    name = "random"

    def choose(self, state: ClusterState, pod: TracePod, rows: np.ndarray, rng: np.random.Generator) -> Choice:
        row = int(rng.choice(rows))
        if pod.num_gpu and pod.gpu_milli < MILLI_PER_CARD:
            able = np.flatnonzero(state.able(pod, np.array([row]))[0])
            return row, tuple(sorted(int(c) for c in rng.choice(able, size=pod.num_gpu, replace=False)))
        return row, first_free(state, row, pod)


class DotProduct(Scored):
    """Tetris-style alignment: the smallest dot product of the node's free (CPU, total GPU) and the pod's
    request, both divided by the largest node's."""

    name = "dotprod"

    def scores(self, state: ClusterState, rows: np.ndarray, pod: TracePod) -> np.ndarray:
        cpu = state.cpu[rows] / MAX_CPU * (pod.cpu_milli / MAX_CPU)
        gpu = state.free[rows].sum(axis=1) / MAX_GPU * (pod.gpu_request / MAX_GPU)
        return _trunc(MAX_SCORE * (1 - (cpu + gpu) / 2))


class GpuClustering(Scored):
    """Pods of one GPU class together: nodes holding only this class first, then mixed ones, then idle
    ones, then nodes of other classes; fuller nodes first within each."""

    name = "gpuclustering"

    def scores(self, state: ClusterState, rows: np.ndarray, pod: TracePod) -> np.ndarray:
        tag = affinity_tag(pod)
        if tag not in state.tags:
            return np.zeros(len(rows), dtype=np.int64)
        affinity = state.affinity[rows]
        kinds = (affinity > 0).sum(axis=1)
        has = affinity[:, state.tags[tag]] > 0
        base = np.where(has, np.where(kinds == 1, 75, 50), np.where(kinds == 0, 25, 0))
        quarter = MAX_SCORE // 4
        return base + _go_div(quarter * (MAX_GPU - state.free[rows].sum(axis=1)), MAX_GPU)


class GpuPacking(Scored):
    """Shared cards first (fuller ones better), then whole free cards on used nodes, then idle nodes."""

    name = "gpupacking"

    def scores(self, state: ClusterState, rows: np.ndarray, pod: TracePod) -> np.ndarray:
        if not pod.num_gpu:
            return np.zeros(len(rows), dtype=np.int64)
        real = state.capacity[rows] > 0
        free = state.free[rows]
        whole = ((free == MILLI_PER_CARD) & real).sum(axis=1)
        idle = whole == real.sum(axis=1)
        able = state.able(pod, rows)
        used = np.sort(np.where(able, free, np.iinfo(np.int64).max), axis=1)[:, : pod.num_gpu]
        used = np.where(used == np.iinfo(np.int64).max, 0, used)
        whole_used = (used == MILLI_PER_CARD).sum(axis=1)
        ratio = (used * 100 // MILLI_PER_CARD).sum(axis=1)
        shared = np.maximum(MAX_SCORE - ratio // 10, MAX_SCORE // 2)
        fresh = np.maximum(MAX_SCORE // 2 - whole_used, MAX_SCORE // 3)
        return np.where(idle, np.maximum(MAX_SCORE // 3 - whole, whole), np.where(whole_used > 0, fresh, shared))


class BestFit(Scored):
    """The least CPU and GPU left over, half weight each, relative to the largest node."""

    name = "bestfit"

    def scores(self, state: ClusterState, rows: np.ndarray, pod: TracePod) -> np.ndarray:
        cpu = (state.cpu[rows] - pod.cpu_milli) / MAX_CPU * 0.5
        gpu = (state.free[rows].sum(axis=1) - pod.gpu_request) / MAX_GPU * 0.5
        return _trunc((1.0 - (0.0 + cpu + gpu)) * MAX_SCORE)


@dataclass(frozen=True, slots=True)
class TypicalPods:
    """The paper's typical pods: the most frequent (CPU, GPU share, GPU count, models) shapes that
    together cover 95% of the pods, with their frequencies renormalised to sum to 1."""

    cpu: np.ndarray
    milli: np.ndarray
    count: np.ndarray
    specs: tuple[str, ...]
    freq: np.ndarray

    @classmethod
    def of(cls, pods: Sequence[TracePod]) -> TypicalPods:
        counts = Counter((p.cpu_milli, p.gpu_milli, p.num_gpu, p.spec) for p in pods)
        ranked = sorted(counts.items(), key=lambda item: (item[1], item[0]), reverse=True)
        total = float(len(pods))
        expected = TYPICAL_COVERAGE * total / 100.0
        kept, cumulative = 0, 0.0
        while cumulative < expected and kept < len(ranked):
            cumulative += ranked[kept][1]
            kept += 1
        freq = np.array([n / total for _, n in ranked[:kept]]) / (cumulative / total)
        shapes = [shape for shape, _ in ranked[:kept]]
        return cls(
            np.array([s[0] for s in shapes], dtype=np.int64),
            np.array([s[1] for s in shapes], dtype=np.int64),
            np.array([s[2] for s in shapes], dtype=np.int64),
            tuple(s[3] for s in shapes),
            freq,
        )


class Fgd(Scored):
    """Fragmentation gradient descent: the placement that grows the node's expected GPU fragmentation
    (idle GPU the typical pods can't use, weighted by their frequency) the least, scored as
    ``int(sigmoid(decrease / 1000) x 100)``."""

    name = "fgd"

    def __init__(self, typical: TypicalPods, state: ClusterState) -> None:
        super().__init__()
        self.typical = typical
        gpu = typical.count > 0
        signatures = sorted({(int(m), int(n)) for m, n in zip(typical.milli[gpu], typical.count[gpu], strict=True)})
        self._sig_milli = np.array([m for m, _ in signatures], dtype=np.int64)
        self._sig_count = np.array([n for _, n in signatures], dtype=np.int64)
        index = {s: i for i, s in enumerate(signatures)}
        self._sig_of = np.array(
            [index.get((int(m), int(n)), 0) for m, n in zip(typical.milli, typical.count, strict=True)], dtype=np.intp
        )
        self._gpu = gpu
        # per (node, typical pod): whether one of the node's cards has a model the pod accepts
        real = state.capacity > 0
        rules = [CardRule(parse_models(spec)) for spec in typical.specs]
        self._model_ok = np.array(
            [(rule.card_mask(state.card_models, state.models) & real).any(axis=1) for rule in rules], dtype=bool
        ).T.reshape(len(state.names), len(rules))

    def fragmentation(self, free: np.ndarray, real: np.ndarray, cpu: np.ndarray, model_ok: np.ndarray) -> np.ndarray:
        """Expected fragmentation of node states: (states, cards) free and real, (states,) CPU left,
        (states, typical pods) whether the node's model suits each."""
        total = free.sum(axis=1)
        if not self._sig_milli.size:
            return total * self.typical.freq.sum()
        hosting = real[:, :, None] & (free[:, :, None] >= self._sig_milli)
        stranded = np.where(hosting, 0, free[:, :, None]).sum(axis=1)
        gpu_fits = hosting.sum(axis=1) >= self._sig_count
        satisfied = gpu_fits[:, self._sig_of] & (cpu[:, None] >= self.typical.cpu) & model_ok & self._gpu
        per_pod = np.where(satisfied, stranded[:, self._sig_of], total[:, None])
        return per_pod @ self.typical.freq

    def _score(self, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        return _trunc(1.0 / (1.0 + np.exp(-(before - after) / 1000)) * MAX_SCORE)

    def _card_scores(self, state: ClusterState, rows: np.ndarray, pod: TracePod) -> np.ndarray:
        """Per (row, card): the score of placing the one-card share there (-1 where it can't go)."""
        free, real, cpu, ok = state.free[rows], state.capacity[rows] > 0, state.cpu[rows], self._model_ok[rows]
        before = self.fragmentation(free, real, cpu, ok)
        nodes, width = free.shape
        after_free = np.repeat(free[:, None, :], width, axis=1)
        after_free[:, np.arange(width), np.arange(width)] -= pod.gpu_milli
        after = self.fragmentation(
            after_free.reshape(nodes * width, width),
            np.repeat(real, width, axis=0),
            np.repeat(cpu - pod.cpu_milli, width),
            np.repeat(ok, width, axis=0),
        ).reshape(nodes, width)
        return np.where(state.able(pod, rows), self._score(before[:, None], after), -1)

    def scores(self, state: ClusterState, rows: np.ndarray, pod: TracePod) -> np.ndarray:
        if pod.num_gpu == 1 and pod.gpu_milli < MILLI_PER_CARD:
            return self._card_scores(state, rows, pod).max(axis=1)
        free, real, cpu, ok = state.free[rows], state.capacity[rows] > 0, state.cpu[rows], self._model_ok[rows]
        before = self.fragmentation(free, real, cpu, ok)
        after_free = free.copy()
        if pod.num_gpu:
            able = state.able(pod, rows)
            first = np.cumsum(able, axis=1) <= pod.num_gpu
            take = state.capacity[rows] if pod.gpu_milli >= MILLI_PER_CARD else pod.gpu_milli
            after_free = np.where(able & first, free - take, free)
        return self._score(before, self.fragmentation(after_free, real, cpu - pod.cpu_milli, ok))

    def cards(self, state: ClusterState, row: int, pod: TracePod, rng: np.random.Generator) -> tuple[int, ...]:
        if pod.num_gpu == 1 and pod.gpu_milli < MILLI_PER_CARD:
            return (int(np.argmax(self._card_scores(state, np.array([row]), pod)[0])),)
        return first_free(state, row, pod)


#: the paper's names for its policies, in its order
PAPER_NAMES = {
    "random": "01-Random",
    "dotprod": "02-DotProd",
    "gpuclustering": "03-GpuClustering",
    "gpupacking": "04-GpuPacking",
    "bestfit": "05-BestFit",
    "fgd": "06-FGD",
}


def baseline(name: str, pods: Sequence[TracePod], state: ClusterState) -> RandomPolicy | Scored:
    """The paper's policy called ``name`` (a key of PAPER_NAMES), set up for this workload and cluster."""
    simple: dict[str, type[Scored]] = {
        "dotprod": DotProduct,
        "gpuclustering": GpuClustering,
        "gpupacking": GpuPacking,
        "bestfit": BestFit,
    }
    if name == "random":
        return RandomPolicy()
    if name == "fgd":
        return Fgd(TypicalPods.of(pods), state)
    return simple[name]()
