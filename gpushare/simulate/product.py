"""The extender's own policies in the replay, driven through the extender's entry points: node costs from
a ``CostMemo`` per demand shape, recomputed for the nodes that changed (as the prioritize verb gets
them), the cheapest node where the pod fits (kube-scheduler takes the extender's best score, equal scores
at random), and the cards from ``batch_place`` on that node's row of the replay's arrays (the cards
``place`` gives the bind verb).

Pods without GPUs never reach the GPU extender entry. kube-scheduler scores them itself: the replay
models its default scoring (NodeResourcesLeastAllocated plus NodeResourcesBalancedAllocation, weight 1
each, 0..100 per plugin), plus, for a policy that weighs CPU and memory, the host entry's prioritize
score (0..10) x ``HOST_WEIGHT`` x 10 (kube-scheduler v1.20 scales extender scores to its 0..100 range);
the highest total wins, equal totals at random.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpushare import placement
from gpushare.simulate.replay import Choice, ClusterState
from gpushare.simulate.trace import TracePod

#: the weight of the host prioritize entry in deploy/scheduler-config.yaml
HOST_WEIGHT = 20
#: kube-scheduler's stand-in request for a pod that requests no CPU (milli) or memory (MiB here)
NONZERO_CPU, NONZERO_MEMORY = 100, 200


def workload(pods: Sequence[TracePod]) -> placement.Workload:
    """What the extender would have observed: the GPU shapes of the pods."""
    return placement.Workload.from_shapes(p.shape for p in pods if p.num_gpu)


def learned(name: str, pods: Sequence[TracePod]) -> placement.Policy:
    """The extender's policy called ``name`` as it would be after watching ``pods``."""
    if name == "fgd":
        return placement.Fgd(workload(pods))
    if name == "fgdfit":
        return placement.FgdFit.of([(p.shape, p.cpu_milli, p.memory_mib, placement.CardRule(p.models)) for p in pods])
    return placement.POLICIES[name]


def kube_default_scores(state: ClusterState, rows: np.ndarray, pod: TracePod) -> np.ndarray:
    """kube-scheduler v1.20's LeastAllocated + BalancedAllocation scores of ``rows`` for ``pod``."""
    cpu, memory = state.cpu_allocatable[rows], state.memory_allocatable[rows]
    cpu_used = cpu - state.cpu[rows] + max(pod.cpu_milli, NONZERO_CPU)
    memory_used = memory - state.memory[rows] + max(pod.memory_mib, NONZERO_MEMORY)
    cpu, memory = np.maximum(cpu, 1), np.maximum(memory, 1)
    least = ((cpu - cpu_used) * 100 // cpu + (memory - memory_used) * 100 // memory) // 2
    cpu_share, memory_share = cpu_used / cpu, memory_used / memory
    balanced = np.trunc((1 - np.abs(cpu_share - memory_share)) * 100).astype(np.int64)
    return least + np.where((cpu_share >= 1) | (memory_share >= 1), 0, balanced)


class ExtenderChooser:
    """One of the extender's policies (``placement.POLICIES``, or one built for a workload)."""

    def __init__(self, policy: placement.Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self._memos: dict[tuple[placement.Shape, frozenset[str], int, int], placement.CostMemo] = {}
        self._hosts: placement.NodeHosts | None = None

    def _costs(self, state: ClusterState, pod: TracePod) -> np.ndarray:
        """Per node: the policy's cost of the pod, from the memo the prioritize verb uses too."""
        shape = pod.shape
        request = (pod.cpu_milli, pod.memory_mib) if self.policy.uses_host else (0, 0)
        key = (shape, pod.models, *request)
        memo = self._memos.get(key)
        if memo is None:
            memo = self._memos[key] = placement.CostMemo()
        if self._hosts is None:
            self._hosts = placement.NodeHosts(
                state.cpu, state.memory, placement.node_order(state.names), state.card_models, state.models
            )
        return memo.costs(
            state.capacity, state.free, state.generation, self._hosts, self.policy, shape, request, state.allowed(pod)
        )

    def choose(self, state: ClusterState, pod: TracePod, rows: np.ndarray, rng: np.random.Generator) -> Choice:
        if not pod.num_gpu:
            scores = kube_default_scores(state, rows, pod)
            if self.policy.uses_host:
                scores = scores + placement.batch_scores(self._costs(state, pod)[rows]) * HOST_WEIGHT * 10
            return int(rng.choice(rows[scores == scores.max()])), ()
        costs = self._costs(state, pod)[rows]
        best = rows[costs == costs.min()]
        row = int(best[0] if best.size == 1 else rng.choice(best))
        one = slice(row, row + 1)
        allowed = state.allowed(pod)
        if allowed is not None:
            allowed = allowed[one]
        choice = placement.batch_place(self.policy, state.capacity[one], state.free[one], pod.shape, None, allowed)
        return row, tuple(sorted(int(card) for card in choice.cards[0]))
