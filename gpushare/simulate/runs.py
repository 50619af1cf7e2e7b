"""Running replays: the policies ``simulate`` knows, the chooser each one replays with, and one run's
result as plain numbers (:class:`Run`), which ``report`` formats.

A run's allocation at an arrived mark is the mean over the pods whose arrival rounds to it, as the paper
measures it. On a small cluster one pod can be several percent of the GPU capacity, so the arrivals can
jump over a mark: it then reads the allocation after the last pod that arrived before it. A mark past the
run's last arrival has no value."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpushare import placement
from gpushare.simulate.baselines import PAPER_NAMES, baseline
from gpushare.simulate.product import ExtenderChooser, learned
from gpushare.simulate.replay import Chooser, ClusterState, arrival_order, replay
from gpushare.simulate.trace import TraceNode, TracePod

#: how the FGD paper's baselines are named among the policies
PAPER_PREFIX = "paper-"


#: the name of the extender's default policy (:data:`gpushare.placement.DEFAULT_POLICY`) among the policies
DEFAULT_ALIAS = "default"


def policy_names() -> list[str]:
    """Every policy ``simulate`` knows: the extender's default, its policies, then the paper's baselines."""
    return [DEFAULT_ALIAS, *placement.POLICIES, *(PAPER_PREFIX + name for name in PAPER_NAMES)]


def policies_to_run(asked: Sequence[str] | None) -> list[str]:
    """The policies to replay, each once: ``asked`` in order, where ``default`` and the policy it stands for
    are one (the first named stays); none asked: every policy under its own name, the alias left out."""
    names = list(asked) if asked else [n for n in policy_names() if n != DEFAULT_ALIAS]
    runs: dict[str, str] = {}
    for name in names:
        runs.setdefault(placement.DEFAULT_POLICY if name == DEFAULT_ALIAS else name, name)
    return list(runs.values())


def chooser(name: str, pods: Sequence[TracePod], state: ClusterState) -> Chooser:
    """The replay's chooser for the policy called ``name`` (one of ``policy_names()``)."""
    if name.startswith(PAPER_PREFIX):
        return baseline(name.removeprefix(PAPER_PREFIX), pods, state)
    return ExtenderChooser(learned(placement.DEFAULT_POLICY if name == DEFAULT_ALIAS else name, pods))


@dataclass(frozen=True, slots=True)
class Run:
    """One replay: per integer arrived-% bucket, the mean allocation % over the pods arriving in it
    (``buckets``) and the allocation % after its last pod (``last``)."""

    trace: str
    policy: str
    seed: int
    buckets: dict[int, float]
    last: dict[int, float]

    @classmethod
    def of(cls, trace: str, policy: str, seed: int, points: Iterable[tuple[int, float]]) -> Run:
        sums: dict[int, float] = {}
        counts: dict[int, int] = {}
        last: dict[int, float] = {}
        for bucket, allocation in points:
            sums[bucket] = sums.get(bucket, 0.0) + allocation
            counts[bucket] = counts.get(bucket, 0) + 1
            last[bucket] = allocation
        return cls(trace, policy, seed, {b: sums[b] / counts[b] for b in sums}, last)

    @property
    def reached(self) -> int:
        """The last arrived-% bucket."""
        return max(self.buckets, default=0)

    def at(self, mark: int) -> float | None:
        """The allocation % when ``mark`` % had arrived (see the module doc); None past the last arrival."""
        if mark in self.buckets:
            return self.buckets[mark]
        if mark > self.reached:
            return None
        before = sorted(self.last)
        i = bisect.bisect_left(before, mark)
        return self.last[before[i - 1]] if i else 0.0

    def skipped(self, mark: int) -> bool:
        """Whether the arrivals jumped over ``mark`` (so ``at`` reads the allocation before it)."""
        return mark not in self.buckets and mark <= self.reached


def run_one(trace: str, nodes: Sequence[TraceNode], pods: Sequence[TracePod], policy: str, seed: int) -> Run:
    """One replay of ``pods`` onto ``nodes`` under ``policy``, in ``seed``'s arrival order."""
    state = ClusterState.of(nodes, pods)
    order = arrival_order(pods, seed, state.total_milli)
    return Run.of(trace, policy, seed, replay(state, order, chooser(policy, pods, state), seed))
