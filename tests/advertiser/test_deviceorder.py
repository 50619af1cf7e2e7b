"""The slice's device order: kube-scheduler's first fit over it takes the card best fit would."""

from __future__ import annotations

from gpushare.advertiser.deviceorder import CardRoom, best_fit_order
from gpushare.advertiser.resourceslice import card_rooms, resource_slice, slice_current

from gpushare.contract.dra import format_device_name
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.placement.dra import DeviceAsk, DraCard, predict

G = GIB.bytes


def first_fit(cards: list[CardRoom], order: tuple[int, ...], gib: int, count: int = 1) -> tuple[str, ...]:
    """The devices kube-scheduler's allocator gives a request of ``gib`` GiB on ``count`` cards, the slice
    listing ``cards`` in ``order``."""
    by_index = {c.index: c for c in cards}
    listed = [DraCard(format_device_name(i), by_index[i].capacity, by_index[i].used, G) for i in order]
    fit = predict(listed, [DeviceAsk("gpu", count, gib * G)])
    assert fit is not None
    return fit.devices


def test_a_share_goes_to_the_fullest_card_that_holds_it_not_to_an_empty_one() -> None:
    cards = [
        CardRoom(0, 80 * G),
        CardRoom(1, 80 * G, used=70 * G),
        CardRoom(2, 80 * G, used=40 * G),
        CardRoom(3, 80 * G, used=78 * G),
    ]
    order = best_fit_order(cards)
    assert first_fit(cards, order, 8) == ("card-1",)  # 10 GiB free: the tightest fit
    assert first_fit(cards, order, 20) == ("card-2",)
    assert first_fit(cards, order, 50) == ("card-0",)  # only the empty card holds it
    assert first_fit(cards, (0, 1, 2, 3), 8) == ("card-0",)  # index order breaks the empty card


def test_a_share_of_two_cards_takes_the_two_tightest() -> None:
    cards = [CardRoom(0, 32 * G), CardRoom(1, 32 * G, used=20 * G), CardRoom(2, 32 * G, used=8 * G)]
    assert first_fit(cards, best_fit_order(cards), 10, count=2) == ("card-1", "card-2")


def test_empty_cards_next_to_used_ones_come_first_so_whole_groups_stay_empty() -> None:
    cards = [
        CardRoom(0, 80 * G, numa=0),
        CardRoom(1, 80 * G, numa=0),
        CardRoom(2, 80 * G, numa=1),
        CardRoom(3, 80 * G, used=80 * G, numa=1),
        CardRoom(4, 80 * G, clique=4),
        CardRoom(5, 80 * G, used=10 * G, clique=4),
    ]
    # full card 3 first (it fits nothing), then card 5; card 2 shares card 3's NUMA node, card 4 card 5's
    # clique; NUMA node 0 (cards 0 and 1) is left whole for a claim that wants two cards of one node
    assert best_fit_order(cards) == (3, 5, 2, 4, 0, 1)


def test_an_idle_node_keeps_index_order_so_publishing_it_changes_nothing() -> None:
    cards = [CardRoom(i, 32 * G, numa=i % 2) for i in (3, 0, 2, 1)]
    assert best_fit_order(cards) == (0, 1, 2, 3)
    assert best_fit_order([]) == ()


def test_cards_as_free_keep_index_order() -> None:
    cards = [CardRoom(2, 32 * G, used=16 * G), CardRoom(0, 32 * G, used=16 * G), CardRoom(1, 32 * G, used=8 * G)]
    assert best_fit_order(cards) == (0, 2, 1)


def test_the_slice_lists_its_devices_in_the_order_given_and_a_new_order_is_a_change() -> None:
    cards = simulated_cards("n1", "4xA100-80GB:81920")
    rooms = card_rooms(cards, GIB, {2: 60 * G, 0: 10 * G})
    assert [(r.index, r.capacity, r.used) for r in rooms] == [
        (0, 80 * G, 10 * G),
        (1, 80 * G, 0),
        (2, 80 * G, 60 * G),
        (3, 80 * G, 0),
    ]
    indexed = resource_slice("n1", cards, GIB, 1)
    ordered = resource_slice("n1", cards, GIB, 1, best_fit_order(rooms))
    assert [d["name"] for d in ordered["spec"]["devices"]] == ["card-2", "card-0", "card-1", "card-3"]
    assert [d["name"] for d in resource_slice("n1", cards, GIB, 1, (3,))["spec"]["devices"]] == [
        "card-3",
        "card-0",
        "card-1",
        "card-2",
    ]
    assert not slice_current(indexed, ordered)
    assert slice_current(ordered, resource_slice("n1", cards, GIB, 2, best_fit_order(rooms)))
