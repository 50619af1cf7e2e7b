"""The array fast path of filter and prioritize agrees with the per-node placement functions, and follows
every change the cache sees."""

from __future__ import annotations

import itertools
import math
import random
import threading

import pytest
from gpushare.extender.asks import read_ask
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.matrix import CostMemo, NodeMatrix
from gpushare.extender.wire import NodeNames
from podfactory import container, gpu_pod
from support.waiting import wait_until

from gpushare import placement
from gpushare.cards import Card
from gpushare.contract.allocation import CardSlice
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY
from gpushare.contract.units import GIB

SHAPES = [
    placement.Shape(1),
    placement.Shape(7),
    placement.Shape(20),
    placement.Shape(40),
    placement.Shape(4, 2),
    placement.Shape(0, 1, True),
    placement.Shape(0, 2, True),
]
_versions = itertools.count(1)


def node_obj(name: str, cards: list[Card] | None) -> dict:
    annotations = {NODE_ANN_INVENTORY: format_inventory(cards, GIB)} if cards is not None else {}
    return {"metadata": {"name": name, "resourceVersion": str(next(_versions)), "annotations": annotations}}


def random_cards(rng: random.Random, name: str) -> list[Card]:
    sizes = rng.choice([[81920] * 8, [40960, 40960, 24576, 15360], [24576], [81920, 15360, 15360]])
    return [
        Card(i, f"GPU-{name}-{i}", "X", mib, minor=i, numa_node=i % 2, healthy=rng.random() > 0.1)
        for i, mib in enumerate(sizes)
    ]


def bound_pod(name: str, node: str, card: Card, units: int) -> dict:
    pod = gpu_pod(
        name, [container("main", units)], node=node, allocation={"main": (CardSlice(card.index, card.uuid, units),)}
    )
    pod["metadata"].update(uid=f"uid-{name}", resourceVersion=str(next(_versions)))
    return pod


@pytest.fixture
def cluster() -> tuple[ClusterCache, list[str]]:
    rng = random.Random(5)
    cache = ClusterCache(None)
    names = []
    for i in range(40):
        name = f"n{i:02d}"
        cards = random_cards(rng, name)
        cache.nodes.apply(node_obj(name, cards))
        for j in range(rng.randint(0, 6)):
            card = rng.choice(cards)
            units = rng.randint(1, card.memory_mib // 1024)
            cache.pods.apply(bound_pod(f"{name}-p{j}", name, card, units))
        names.append(name)
    cache.nodes.apply(node_obj("plain", None))
    return cache, [*names, "plain", "ghost"]


def demand(shape: placement.Shape) -> placement.Demand:
    return placement.Demand("main", shape.units, shape.cards, shape.exclusive)


def test_fits_agrees_with_check_fit_on_every_node(cluster: tuple[ClusterCache, list[str]]) -> None:
    cache, names = cluster
    matrix = NodeMatrix(cache)
    outcomes: set[bool] = set()
    for shape in SHAPES:
        expected = [
            cache.view(n) is not None and placement.check_fit(cache.view(n).cards, [demand(shape)]) is None
            for n in names
        ]
        assert matrix.fits(NodeNames.of(names), shape).tolist() == expected, shape
        outcomes.update(expected[:-2])
    assert outcomes == {True, False}, "the random cluster should have nodes that fit and nodes that don't"


def node_costs(cache: ClusterCache, names: list[str], policy: placement.Policy, shape: placement.Shape) -> list:
    """Each node's cost as the per-node path computes it (``inf`` where the demand can't go)."""
    costs = []
    for name in names:
        view = cache.view(name)
        try:
            costs.append(placement.node_cost(view.cards, [demand(shape)], policy) if view else math.inf)
        except placement.NoFit:
            costs.append(math.inf)
    return costs


@pytest.mark.parametrize("policy", ["binpack", "spread", "fgd"])
def test_batch_costs_agree_with_node_cost(cluster: tuple[ClusterCache, list[str]], policy: str) -> None:
    cache, names = cluster
    matrix = NodeMatrix(cache)
    chosen = placement.POLICIES[policy]
    for shape in [s for s in SHAPES if s.cards == 1]:
        costs = matrix.costs(NodeNames.of(names), CostMemo(), chosen, shape).tolist()
        assert costs == pytest.approx(node_costs(cache, names, chosen, shape)), shape


def test_a_rebuilt_fgd_workload_takes_over_once_its_costs_are_ready(
    cluster: tuple[ClusterCache, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, names = cluster
    engine = PlacementEngine(cache, "fgd")
    asked, shape = NodeNames.of(names), placement.Shape(7)
    before = engine.policy_for(read_ask({}))[1]
    assert engine.batch_costs(asked, shape, "fgd").tolist() == pytest.approx(node_costs(cache, names, before, shape))
    release = threading.Event()
    memo = engine.matrix.memo

    def held(
        policy: placement.Policy,
        shape: placement.Shape,
        request: tuple[int, int] = (0, 0),
        rule: placement.CardRule = placement.ANY_CARD,
    ) -> CostMemo:
        release.wait()
        return memo(policy, shape, request, rule)

    monkeypatch.setattr(engine.matrix, "memo", held)
    try:
        for i in range(len(cache.observed_shapes()) // 20 + 1):  # pending pods of a new shape: a new workload
            cache.pods.apply(gpu_pod(f"new-{i}", [container("main", 33, 3)], node=None))
        # the rebuild waits for its costs; meanwhile the workload built before answers, without waiting
        assert engine.policy_for(read_ask({}))[1] is before
        assert engine.batch_costs(asked, shape, "fgd").tolist() == pytest.approx(
            node_costs(cache, names, before, shape)
        )
    finally:
        release.set()
    after = wait_until(lambda: engine.policy_for(read_ask({}))[1] is not before and engine.policy_for(read_ask({}))[1])
    assert placement.Shape(11, 3) in after.workload.shapes and placement.Shape(11, 3) not in before.workload.shapes
    assert engine.batch_costs(asked, shape, "fgd").tolist() == pytest.approx(node_costs(cache, names, after, shape))


def test_rows_and_memoised_costs_follow_changes(cluster: tuple[ClusterCache, list[str]]) -> None:
    cache, _ = cluster
    matrix = NodeMatrix(cache)
    memo = CostMemo()
    binpack = placement.POLICIES["binpack"]
    shape = placement.Shape(5)
    new = NodeNames.of(["new"])

    def fit(*shape: int | bool) -> bool:
        return bool(matrix.fits(new, placement.Shape(*shape))[0])

    fresh = [Card(i, f"GPU-new-{i}", "X", 10240, minor=i) for i in range(2)]
    cache.nodes.apply(node_obj("new", fresh))
    assert matrix.costs(new, memo, binpack, shape).tolist() == [15.0]
    cache.pods.apply(bound_pod("taker", "new", fresh[0], 8))
    assert (fit(2, 2), fit(3, 2), fit(10)) == (True, False, True)  # 2 and 10 GiB free
    assert matrix.costs(new, memo, binpack, shape).tolist() == [7.0]
    cache.pods.apply({**bound_pod("taker", "new", fresh[0], 8), "status": {"phase": "Succeeded"}})
    assert matrix.costs(new, memo, binpack, shape).tolist() == [15.0]
    unhealthy = [fresh[0], Card(1, fresh[1].uuid, "X", 10240, minor=1, healthy=False)]
    cache.nodes.apply(node_obj("new", unhealthy))
    assert (fit(0, 1, True), fit(0, 2, True), fit(1, 2)) == (True, False, False)
    assert matrix.costs(new, memo, binpack, shape).tolist() == [5.0]
    cache.nodes.apply(node_obj("new", None))
    assert matrix.costs(new, memo, binpack, shape).tolist() == [math.inf]
    assert not fit(1)
    cache.nodes.apply(node_obj("new", fresh))
    assert matrix.costs(new, memo, binpack, shape).tolist() == [15.0]


def test_nodes_with_more_cards_than_seen_so_far_widen_the_rows() -> None:
    cache = ClusterCache(None)
    matrix = NodeMatrix(cache)
    cache.nodes.apply(node_obj("a", [Card(0, "GPU-a", "X", 1024, minor=0)]))
    assert matrix.fits(NodeNames.of(["a"]), placement.Shape(1)).tolist() == [True]
    wide = [Card(i, f"GPU-w{i}", "X", 2048, minor=i) for i in range(12)]
    cache.nodes.apply(node_obj("w", wide))
    both = NodeNames.of(["w", "a"])
    assert matrix.fits(both, placement.Shape(2, 12)).tolist() == [True, False]
    assert matrix.fits(both, placement.Shape(0, 12, True)).tolist() == [True, False]


def test_a_node_that_appears_later_is_found_in_a_list_asked_before() -> None:
    cache = ClusterCache(None)
    matrix = NodeMatrix(cache)
    cache.nodes.apply(node_obj("a", [Card(0, "GPU-a", "X", 1024, minor=0)]))
    asked = NodeNames.of(["a", "late"])
    assert matrix.fits(asked, placement.Shape(1)).tolist() == [True, False]
    cache.nodes.apply(node_obj("late", [Card(0, "GPU-late", "X", 4096, minor=0)]))
    assert matrix.fits(NodeNames.of(["a", "late"]), placement.Shape(1)).tolist() == [True, True]
    assert matrix.fits(asked, placement.Shape(4)).tolist() == [False, True]


def test_names_that_json_escapes_are_looked_up_too() -> None:
    cache = ClusterCache(None)
    matrix = NodeMatrix(cache)
    odd = ['a", "b', "a", "b"]
    for name in odd:
        cache.nodes.apply(node_obj(name, [Card(0, f"GPU-{name}", "X", 1024 * (1 + len(name)), minor=0)]))
    assert NodeNames.of(odd).text is None
    assert matrix.fits(NodeNames.of(odd), placement.Shape(2)).tolist() == [True, True, True]
    assert matrix.fits(NodeNames.of(odd), placement.Shape(3)).tolist() == [True, False, False]
    assert matrix.fits(NodeNames.of(["a", "b"]), placement.Shape(3)).tolist() == [False, False]
