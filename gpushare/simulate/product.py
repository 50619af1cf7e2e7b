"""The extender's own policies in the replay, driven through the extender's entry points: node costs from
``batch_place`` memoised per node generation (as the prioritize verb gets them), the cheapest node where
the pod fits (kube-scheduler takes the extender's best score, equal scores at random), and the cards
from ``place`` (as the bind verb gets them).

Pods without GPUs never reach the extender (kube-scheduler calls it only for pods that request GPUs),
so the replay puts them on a random node where they fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpushare import placement
from gpushare.placement.memo import RowMemo
from gpushare.simulate.replay import Choice, ClusterState
from gpushare.simulate.trace import MILLI_PER_CARD, TracePod


def gpu_shape(pod: TracePod) -> placement.Shape:
    """A trace pod's GPU request as a placement shape: whole cards, or a share of each card."""
    if pod.gpu_milli >= MILLI_PER_CARD:
        return placement.Shape(0, pod.num_gpu, exclusive=True)
    return placement.Shape(pod.gpu_milli, pod.num_gpu)


def workload(pods: Sequence[TracePod]) -> placement.Workload:
    """What the extender would have observed: the GPU shapes of the pods."""
    return placement.Workload.from_shapes(gpu_shape(p) for p in pods if p.num_gpu)


def node_cards(state: ClusterState, row: int) -> list[placement.Card]:
    return [
        placement.Card(index=j, uuid=f"{state.names[row]}/{j}", capacity=int(cap), used=int(cap - free))
        for j, (cap, free) in enumerate(zip(state.capacity[row], state.free[row], strict=True))
        if cap > 0
    ]


class ExtenderChooser:
    """One of the extender's policies (``placement.POLICIES``, or one built for a workload)."""

    def __init__(self, policy: placement.Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self._memos: dict[placement.Shape, RowMemo] = {}

    def choose(self, state: ClusterState, pod: TracePod, rows: np.ndarray, rng: np.random.Generator) -> Choice:
        if not pod.num_gpu:
            return int(rng.choice(rows)), ()
        shape = gpu_shape(pod)
        memo = self._memos.get(shape)
        if memo is None:
            memo = self._memos[shape] = RowMemo()
        costs = memo.values(
            state.generation,
            lambda stale: placement.batch_place(self.policy, state.capacity[stale], state.free[stale], shape).cost,
        )[rows]
        best = rows[costs == costs.min()]
        row = int(best[0] if best.size == 1 else rng.choice(best))
        demand = placement.Demand("main", shape.units, shape.cards, shape.exclusive)
        (assignment,) = placement.place(node_cards(state, row), [demand], self.policy, unit="milli")
        return row, tuple(index for index, _, _ in assignment.cards)
