"""The DRA allocator's first fit on one node, predicted, and the scores that steer DRA pods to the node
where it packs tightest."""

from __future__ import annotations

from gpushare.placement.dra import DeviceAsk, DraCard, DraFit, dra_scores, predict

GIB = 1 << 30


def cards(*used_gib: int, capacity_gib: int = 32, unit: int = GIB) -> tuple[DraCard, ...]:
    return tuple(DraCard(f"card-{i}", capacity_gib * GIB, used * GIB, unit) for i, used in enumerate(used_gib))


def test_the_allocator_takes_the_first_card_with_room_not_the_tightest() -> None:
    fit = predict(cards(30, 20, 26), [DeviceAsk("gpu", 1, 4 * GIB)])
    assert fit == DraFit(("card-1",), 8 * GIB)


def test_a_request_for_several_cards_takes_distinct_cards_and_fails_without_enough() -> None:
    assert predict(cards(0, 30, 0, 0), [DeviceAsk("gpu", 2, 8 * GIB)]) == DraFit(("card-0", "card-2"), 48 * GIB)
    assert predict(cards(0, 30, 30), [DeviceAsk("gpu", 2, 8 * GIB)]) is None


def test_a_later_request_sees_what_an_earlier_one_took() -> None:
    fit = predict(cards(16, 0), [DeviceAsk("gpu", 1, 12 * GIB), DeviceAsk("gpu", 1, 8 * GIB)])
    assert fit == DraFit(("card-0", "card-1"), 4 * GIB + 24 * GIB)


def test_memory_is_consumed_in_whole_units_of_the_card() -> None:
    # 1 GiB units: 1.5 GiB takes 2 GiB, so a card with 1.5 GiB free can't hold it
    half = GIB // 2
    assert predict((DraCard("card-0", 32 * GIB, 32 * GIB - 3 * half, GIB),), [DeviceAsk("gpu", 1, 3 * half)]) is None
    assert predict(cards(0), [DeviceAsk("gpu", 1, 3 * half)]) == DraFit(("card-0",), 30 * GIB)


def test_the_tightest_fit_scores_ten_and_nodes_where_the_claim_does_not_fit_zero() -> None:
    ask = [DeviceAsk("gpu", 1, 8 * GIB)]
    # left on the first card with room: 24, 4, none, 8 GiB
    nodes = [cards(0, 0), cards(20, 0), cards(30, 30), cards(16, 0)]
    assert dra_scores([predict(node, ask) for node in nodes]).tolist() == [0, 10, 0, 8]


def test_no_node_fitting_scores_zero_everywhere() -> None:
    assert dra_scores([None, None]).tolist() == [0, 0]
