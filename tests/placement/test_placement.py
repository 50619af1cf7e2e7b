"""Placement: card choice on one node, policies, fragmentation, and the many-node path the replay uses."""

import itertools
import math
import random

import numpy as np
import pytest

from gpushare.placement import (
    POLICIES,
    CardCapacity,
    Demand,
    Fgd,
    HostFit,
    NoFit,
    Shape,
    Workload,
    batch_place,
    batch_scores,
    check_fit,
    fragmentation,
    node_cost,
    place,
    shape_key,
)
from gpushare.placement.fragmentation import most_common, placement_deltas

BINPACK, SPREAD, FGD = POLICIES["binpack"], POLICIES["spread"], POLICIES["fgd"]


def cards(*free_of_capacity: tuple[int, int], **overrides: dict) -> list[CardCapacity]:
    """Cards 0..n-1 from (free, capacity) pairs."""
    return [
        CardCapacity(i, f"GPU-{i}", capacity, capacity - free, **overrides.get(f"c{i}", {}))
        for i, (free, capacity) in enumerate(free_of_capacity)
    ]


def taken(assignments) -> dict[str, list[tuple[int, int]]]:
    return {a.container: [(index, units) for index, _, units in a.cards] for a in assignments}


# --- semantics -------------------------------------------------------------------------------------


def test_mixed_cards_use_each_cards_own_capacity() -> None:
    node = cards((16, 16), (40, 40))
    assert taken(place(node, [Demand("main", 20)], BINPACK)) == {"main": [(1, 20)]}
    assert (
        check_fit(node, [Demand("main", 41)]).reason
        == "no single card has 41 GiB free (largest free: 40 GiB on card 1)"
    )


def test_unhealthy_cards_are_never_used() -> None:
    node = cards((16, 16), (40, 40), c1={"healthy": False})
    assert taken(place(node, [Demand("main", 10)], SPREAD)) == {"main": [(0, 10)]}
    with pytest.raises(NoFit, match="largest free: 16 GiB on card 0"):
        place(node, [Demand("main", 20)], BINPACK)
    only_sick = cards((16, 16), c0={"healthy": False})
    assert check_fit(only_sick, [Demand("main", 1)]).reason == "no healthy card (1 unhealthy)"
    assert check_fit([], [Demand("main", 1)]).reason == "node has no GPUs"


def test_nofit_wording_names_the_largest_free_card() -> None:
    node = cards((2, 16), (4, 16), (1, 16), (8, 16))
    with pytest.raises(NoFit) as err:
        place(node, [Demand("main", 12)], BINPACK)
    assert err.value.reason == "no single card has 12 GiB free (largest free: 8 GiB on card 3)"
    assert check_fit(node, [Demand("main", 12)], unit="x 512MiB").reason.startswith("no single card has 12 x 512MiB")


def test_mem_only_shares_one_card() -> None:
    node = cards((6, 16), (16, 16))
    assert taken(place(node, [Demand("main", 5)], BINPACK)) == {"main": [(0, 5)]}


def test_count_only_takes_whole_free_cards_and_rejects_partly_used_ones() -> None:
    node = cards((15, 16), (16, 16), (24, 24))
    assert taken(place(node, [Demand("main", 0, 2, exclusive=True)], BINPACK)) == {"main": [(1, 16), (2, 24)]}
    reason = check_fit(node, [Demand("main", 0, 3, exclusive=True)]).reason
    assert reason == "needs 3 whole free cards, 2 completely free (3 cards)"
    partly_used = cards((15, 16))
    assert check_fit(partly_used, [Demand("main", 0, 1, exclusive=True)]) is not None
    with pytest.raises(NoFit, match="needs a whole free card"):
        place(partly_used, [Demand("main", 0, 1, exclusive=True)], SPREAD)


def test_mem_and_count_take_distinct_cards_with_a_share_each() -> None:
    node = cards((8, 16), (3, 16), (16, 16), (5, 16))
    assert taken(place(node, [Demand("main", 4, 2)], BINPACK)) == {"main": [(0, 4), (3, 4)]}
    assert taken(place(node, [Demand("main", 4, 2)], SPREAD)) == {"main": [(0, 4), (2, 4)]}
    reason = check_fit(node, [Demand("main", 6, 3)]).reason
    assert reason == "needs 3 cards with 6 GiB free each, 2 have (largest free: 16 GiB on card 2)"


def test_containers_of_one_pod_never_double_book_a_card() -> None:
    node = cards((10, 16), (10, 16))
    result = taken(place(node, [Demand("a", 6), Demand("b", 6)], BINPACK))
    assert sorted(card for slices in result.values() for card, _ in slices) == [0, 1]
    with pytest.raises(NoFit) as err:
        place(node, [Demand("a", 6), Demand("b", 6), Demand("c", 6)], BINPACK)
    assert (
        err.value.reason == "containers a, b, c each fit alone but not together (free GiB: 10 on card 0, 10 on card 1)"
    )


def test_earlier_choices_are_revisited_when_a_later_container_would_not_fit() -> None:
    # spread's first choice for "pair" is cards 0 and 1, which leaves no card with 8 free for "big"
    node = cards((8, 16), (4, 16), (4, 16))
    result = taken(place(node, [Demand("big", 8), Demand("pair", 4, 2)], SPREAD))
    assert result == {"big": [(0, 8)], "pair": [(1, 4), (2, 4)]}
    assert check_fit(node, [Demand("big", 8), Demand("pair", 4, 2)]) is None


def test_check_fit_agrees_with_exhaustive_search() -> None:
    rng = random.Random(7)
    for _ in range(300):
        node = [CardCapacity(i, f"G{i}", 8, rng.choice([0, 2, 4, 8]), healthy=rng.random() > 0.1) for i in range(3)]
        demands = [
            Demand(f"c{j}", 0, rng.choice([1, 2]), exclusive=True)
            if rng.random() < 0.2
            else Demand(f"c{j}", rng.choice([1, 2, 3, 4, 6]), rng.choice([1, 1, 2]))
            for j in range(rng.choice([1, 2, 3]))
        ]
        assert (check_fit(node, demands) is None) == _fits_exhaustively(node, demands), (node, demands)


def _fits_exhaustively(node: list[CardCapacity], demands: list[Demand]) -> bool:
    def search(i: int, free: list[int]) -> bool:
        if i == len(demands):
            return True
        d = demands[i]
        for group in itertools.combinations(range(len(node)), d.cards):
            if d.exclusive:
                usable = all(node[p].healthy and free[p] == node[p].capacity for p in group)
                rest = [0 if p in group else f for p, f in enumerate(free)]
            else:
                usable = all(free[p] >= d.units for p in group)
                rest = [f - d.units if p in group else f for p, f in enumerate(free)]
            if usable and search(i + 1, rest):
                return True
        return False

    return search(0, [c.free for c in node])


def test_result_does_not_depend_on_input_order() -> None:
    node = cards((8, 16), (12, 16), (16, 16), (3, 16), (16, 24))
    demands = [Demand("a", 3), Demand("b", 0, 1, exclusive=True), Demand("c", 2, 2)]
    for policy in POLICIES.values():
        expected = taken(place(node, demands, policy))
        for seed in range(5):
            shuffled_cards, shuffled_demands = list(node), list(demands)
            random.Random(seed).shuffle(shuffled_cards)
            random.Random(seed).shuffle(shuffled_demands)
            assert taken(place(shuffled_cards, shuffled_demands, policy)) == expected
            assert node_cost(shuffled_cards, shuffled_demands, policy) == node_cost(node, demands, policy)
    assert shape_key(demands) == shape_key(list(reversed(demands)))


def test_bad_demands_are_refused_with_the_container_named() -> None:
    with pytest.raises(ValueError, match="container x"):
        Demand("x", 0)
    with pytest.raises(ValueError, match="container x"):
        Demand("x", 4, 2, exclusive=True)
    with pytest.raises(ValueError, match="more than once"):
        place(cards((8, 8)), [Demand("x", 1), Demand("x", 1)], BINPACK)


# --- topology ----------------------------------------------------------------------------------------


def test_multi_card_demands_prefer_nvlink_then_numa() -> None:
    plain = cards((16, 16), (16, 16), (16, 16), (16, 16))
    numa = [CardCapacity(c.index, c.uuid, c.capacity, c.used, numa=c.index % 2) for c in plain]
    assert taken(place(numa, [Demand("m", 0, 2, exclusive=True)], BINPACK)) == {"m": [(0, 16), (2, 16)]}
    linked = [
        CardCapacity(
            c.index, c.uuid, c.capacity, c.used, numa=c.numa, nvlink=frozenset({"GPU-3"} if c.index == 1 else ())
        )
        for c in numa
    ]
    assert taken(place(linked, [Demand("m", 0, 2, exclusive=True)], BINPACK)) == {"m": [(1, 16), (3, 16)]}
    assert taken(place(plain, [Demand("m", 0, 2, exclusive=True)], BINPACK)) == {"m": [(0, 16), (1, 16)]}


def test_multi_card_demands_prefer_nvlink_then_numa_over_the_policys_card_order() -> None:
    node = [
        CardCapacity(0, "GPU-0", 16, 12, numa=0),
        CardCapacity(1, "GPU-1", 16, 12, numa=1),
        CardCapacity(2, "GPU-2", 16, 0, numa=1, nvlink=frozenset({"GPU-3"})),
        CardCapacity(3, "GPU-3", 16, 0, numa=1),
    ]
    # binpack alone would take the two fullest cards, which share nothing
    assert taken(place(node, [Demand("m", 2, 2)], BINPACK)) == {"m": [(2, 2), (3, 2)]}
    no_link = [CardCapacity(c.index, c.uuid, c.capacity, c.used, numa=c.numa) for c in node]
    # without NVLink, a shared NUMA node wins; binpack then picks the fullest such pair
    assert taken(place(no_link, [Demand("m", 2, 2)], BINPACK)) == {"m": [(1, 2), (2, 2)]}
    flat = [CardCapacity(c.index, c.uuid, c.capacity, c.used) for c in node]
    # with no topology at all the policy decides
    assert taken(place(flat, [Demand("m", 2, 2)], BINPACK)) == {"m": [(0, 2), (1, 2)]}
    assert taken(place(flat, [Demand("m", 2, 2)], SPREAD)) == {"m": [(2, 2), (3, 2)]}


# --- policies ----------------------------------------------------------------------------------------


def test_binpack_and_spread_choose_different_cards_and_nodes() -> None:
    node = cards((4, 16), (10, 16), (16, 16))
    assert taken(place(node, [Demand("m", 3)], BINPACK)) == {"m": [(0, 3)]}
    assert taken(place(node, [Demand("m", 3)], SPREAD)) == {"m": [(2, 3)]}
    full, empty = cards((4, 16), (0, 16)), cards((16, 16), (16, 16))
    demand = [Demand("m", 3)]
    binpack = batch_scores(np.array([node_cost(full, demand, BINPACK), node_cost(empty, demand, BINPACK)]))
    spread = batch_scores(np.array([node_cost(full, demand, SPREAD), node_cost(empty, demand, SPREAD)]))
    assert binpack.tolist() == [10, 0]  # full, empty
    assert spread.tolist() == [0, 10]


def test_fgd_keeps_a_typical_shape_placeable() -> None:
    node = cards((12, 16), (16, 16))
    fgd = Fgd(Workload.from_shapes([Shape(12)] * 9 + [Shape(4)]))
    # binpack squeezes card 0 to 8, where a typical 12 no longer fits; fgd takes 4 from card 1
    assert taken(place(node, [Demand("m", 4)], BINPACK)) == {"m": [(0, 4)]}
    assert taken(place(node, [Demand("m", 4)], fgd)) == {"m": [(1, 4)]}
    assert node_cost(node, [Demand("m", 4)], fgd) == 0
    frag = fragmentation(np.array([[8, 16], [12, 12]]), np.full((2, 2), 16), fgd.workload)
    assert frag[0] > frag[1]


def test_fgd_prefers_the_node_whose_fragmentation_grows_least() -> None:
    fgd = Fgd(Workload.from_shapes([Shape(0, 1, exclusive=True)] * 3 + [Shape(8)]))
    demand = [Demand("m", 8)]
    # on "lone" the 8 units break the only whole card; on "half" they fill a half-used card
    lone = cards((16, 16), (0, 16))
    half = cards((16, 16), (8, 16))
    costs = [node_cost(lone, demand, fgd), node_cost(half, demand, fgd)]
    assert costs == [6.0, -6.0]
    assert batch_scores(np.array(costs)).tolist() == [0, 10]
    assert taken(place(half, demand, fgd)) == {"m": [(1, 8)]}


def test_fgd_without_observed_shapes_treats_the_pod_as_typical() -> None:
    node = cards((12, 16), (16, 16))
    # 10 from card 0 strands 2 units for the next pod like it, from card 1 it would strand 6
    assert taken(place(node, [Demand("m", 10)], FGD)) == {"m": [(0, 10)]}
    assert taken(place(node, [Demand("m", 10)], SPREAD)) == {"m": [(1, 10)]}


def test_scores_span_zero_to_ten_round_half_to_even_and_handle_ties_and_misfits() -> None:
    def scores(*costs: float) -> list[int]:
        return batch_scores(np.array(costs, dtype=float)).tolist()

    assert scores() == []
    assert scores(3.0, 3.0) == [10, 10]
    assert scores(-5.0, 0.0, 5.0) == [10, 5, 0]
    assert scores(0.0, 0.25, 0.75, 1.0, 0.05, 0.15) == [10, 8, 2, 0, 10, 8]  # x.5 goes to the even neighbour
    assert scores(math.inf, 2.0, math.inf, 4.0) == [0, 10, 0, 0]
    assert scores(math.inf, 7.0) == [0, 10]
    assert scores(math.inf, math.inf) == [0, 0]


# --- workload and fragmentation -------------------------------------------------------------------


def test_workload_keeps_the_most_common_shapes_in_a_stable_order() -> None:
    observed = [Shape(4)] * 6 + [Shape(8)] * 3 + [Shape(2)] + [Shape(1)]
    workload = Workload.from_shapes(observed, coverage=0.8)
    assert workload.shapes == (Shape(4), Shape(8))
    assert workload.counts == (6, 3)
    assert Workload.from_shapes(reversed(observed), coverage=0.8) == workload
    assert len(Workload.from_shapes([])) == 0
    assert [k for k, _ in most_common("aaabbc", coverage=0.5, step=2)] == ["a", "b"]
    assert [k for k, _ in most_common("aabbcc", coverage=0.3)] == ["c"]


def test_fragmentation_counts_idle_units_a_typical_shape_cannot_use() -> None:
    workload = Workload((Shape(8), Shape(0, 2, exclusive=True), Shape(0, 0)), (2, 1, 1))
    free, capacity = np.array([[6, 16, 0]] * 2), np.full((2, 3), 16)
    # Shape(8): card 0's 6 are stranded; two whole cards: impossible, all 22 idle; no-GPU shape: all 22
    assert fragmentation(free, capacity, workload).tolist() == [(2 * 6 + 22 + 22) / 4] * 2
    # on node 1 the host can't take Shape(8) apart from its GPUs: its idle units are all fragments
    host_ok = np.array([[True, True, True], [False, True, True]])
    assert fragmentation(free, capacity, workload, host_ok).tolist() == [(2 * 6 + 22 + 22) / 4, (2 * 22 + 22 + 22) / 4]


def _random_cluster(rng: random.Random, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    capacity = np.array([[16] * (n := rng.choice([1, 2, 4])) + [0] * (4 - n) for _ in range(nodes)])
    free = np.array([[rng.choice([0, 3, 8, 12, 16]) if c else 0 for c in row] for row in capacity])
    return capacity, np.minimum(free, capacity)


def test_placement_deltas_are_the_change_in_fragmentation() -> None:
    rng = random.Random(3)
    workload = Workload(
        (Shape(8), Shape(3), Shape(0, 1, exclusive=True), Shape(0, 2, exclusive=True), Shape(0, 0)), (5, 2, 4, 1, 2)
    )
    capacity, free = _random_cluster(rng, 40)
    before = np.array([[rng.random() < 0.8 for _ in workload.shapes] for _ in free])
    after = before & np.array([[rng.random() < 0.8 for _ in workload.shapes] for _ in free])
    take = np.full_like(free, 3)
    deltas = placement_deltas(free, capacity, workload, take, before, after)
    plain = placement_deltas(free, capacity, workload, take)
    for c in range(4):
        rest = free.copy()
        rest[:, c] -= 3
        expected = fragmentation(rest, capacity, workload, after) - fragmentation(free, capacity, workload, before)
        assert deltas[:, c] == pytest.approx(expected, abs=1e-9)
        assert plain[:, c] == pytest.approx(
            fragmentation(rest, capacity, workload) - fragmentation(free, capacity, workload)
        )


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("shape", [Shape(3), Shape(8), Shape(0, 1, exclusive=True), Shape(0, 2, exclusive=True)])
def test_many_nodes_at_once_choose_as_one_node_at_a_time(name: str, shape: Shape) -> None:
    policy = Fgd(Workload((Shape(8), Shape(0, 1, exclusive=True)), (3, 2))) if name == "fgd" else POLICIES[name]
    capacity, free = _random_cluster(random.Random(11), 60)
    choice = batch_place(policy, capacity, free, shape)
    demand = Demand("m", shape.units, shape.cards, shape.exclusive)
    for n in range(len(free)):
        node = [
            CardCapacity(c, f"G{c}", int(capacity[n, c]), int(capacity[n, c] - free[n, c]))
            for c in range(4)
            if capacity[n, c]
        ]
        if check_fit(node, [demand]) is not None:
            assert choice.cost[n] == np.inf
            continue
        assert choice.cost[n] == pytest.approx(node_cost(node, [demand], policy), abs=1e-9)
        assert sorted(choice.cards[n].tolist()) == [i for i, _, _ in place(node, [demand], policy)[0].cards]


def test_vectorised_fgd_counts_what_the_host_can_no_longer_fit() -> None:
    workload = Workload((Shape(8), Shape(0, 0)), (1, 1))
    policy = Fgd(workload)
    capacity = np.array([[16, 16], [16, 16]])
    free = capacity.copy()
    # node 1 would lose room (e.g. CPU) for the 8-unit shape: all its idle units become fragments
    host = HostFit(np.array([[True, True], [True, True]]), np.array([[True, True], [False, True]]))
    choice = batch_place(policy, capacity, free, Shape(8), host)
    assert choice.cost[0] < choice.cost[1]
    with pytest.raises(ValueError, match="no workload"):
        batch_place(Fgd(), capacity, free, Shape(8), host)
