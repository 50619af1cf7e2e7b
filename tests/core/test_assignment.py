"""The one assignment check the device plugin and the CRI shim share: what it refuses, and how it says so."""

from dataclasses import replace

from gpushare.assignment import Claim, Holdings, check_extender_decision
from gpushare.cards import ENFORCED
from gpushare.contract.allocation import CardSlice
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SIMULATED_LIMITS, simulated_cards
from gpushare.holdings.pod import PodCards
from gpushare.placement import CardRule

CARDS = simulated_cards("n1", "2xA100-80GB:81920,1xT4:15360")
A0, A1, T4 = CARDS


def claim(*slices: CardSlice, exclusive: bool = False) -> Claim:
    return Claim("ns/train", "uid-train", "main", slices, exclusive=exclusive)


def holding(key: str, uid: str, card_uuid: str, units: int) -> PodCards:
    return PodCards(key, uid, {"main": (CardSlice(0, card_uuid, units),)}, {card_uuid: units})


def test_a_pod_not_yet_counted_adds_its_units_and_is_named_among_the_holders() -> None:
    others = [holding("ns/a", "uid-a", A0.uuid, 76)]
    held = Holdings({A0.uuid: 76, A1.uuid: 0, T4.uuid: 0}, others)
    assert check_extender_decision(claim(CardSlice(0, A0.uuid, 4)), CARDS, GIB, held) is None
    refused = check_extender_decision(claim(CardSlice(0, A0.uuid, 5)), CARDS, GIB, held)
    assert refused is not None and refused.reason == "overcommit" and not refused.invalid_input
    assert refused.message == (
        f"pod ns/train container main: card 0 ({A0.uuid}) would be over-committed: live pods on this node "
        "claim 81 of its 80 GiB unit(s): ns/a (76), ns/train (5)"
    )


def test_a_pod_already_counted_is_not_counted_twice() -> None:
    mine = holding("ns/train", "uid-train", T4.uuid, 15)
    held = Holdings({A0.uuid: 0, A1.uuid: 0, T4.uuid: 15}, [mine])
    assert check_extender_decision(claim(CardSlice(2, T4.uuid, 15)), CARDS, GIB, held) is None
    # without a uid, the pod is recognised by its name
    nameless = Claim("ns/train", "", "main", (CardSlice(2, T4.uuid, 15),))
    assert (
        check_extender_decision(nameless, CARDS, GIB, Holdings(held.used, [holding("ns/train", "", T4.uuid, 15)]))
        is None
    )


def test_cards_are_checked_before_capacity_and_without_holdings() -> None:
    ghost = check_extender_decision(claim(CardSlice(7, "GPU-ffff", 1)), CARDS, GIB, None)
    assert ghost is not None and ghost.reason == "unknown-card"
    assert ghost.message == "pod ns/train container main: assigned card 7 (GPU-ffff) is not on this node"
    moved = check_extender_decision(claim(CardSlice(1, A0.uuid, 1)), CARDS, GIB, None)
    assert moved is not None and moved.reason == "unknown-card"
    assert f"assigned card {A0.uuid} is index 0 here, not 1 as annotated" in moved.message
    assert check_extender_decision(claim(CardSlice(0, A0.uuid, 999)), CARDS, GIB, None) is None  # no view of the pods


def test_an_unhealthy_card_is_refused_only_to_a_new_allocation() -> None:
    cards = [A0.with_health(False), A1, T4]
    refused = check_extender_decision(claim(CardSlice(0, A0.uuid, 1)), cards, GIB, None)
    assert refused is not None and refused.reason == "unhealthy-card"
    assert check_extender_decision(claim(CardSlice(0, A0.uuid, 1)), cards, GIB, None, require_healthy=False) is None


def test_a_whole_card_request_given_part_of_a_card_is_bad_input() -> None:
    refused = check_extender_decision(claim(CardSlice(2, T4.uuid, 10), exclusive=True), CARDS, GIB, None)
    assert refused is not None and refused.invalid_input and refused.reason == "bad-annotation"
    assert "whole but is assigned 10 of its 15 unit(s)" in refused.message
    assert check_extender_decision(claim(CardSlice(2, T4.uuid, 15), exclusive=True), CARDS, GIB, None) is None


def test_a_pod_requiring_memory_limits_is_refused_a_card_that_doesnt_enforce_them() -> None:
    required = CardRule(memory_limits=True)
    slices = (CardSlice(0, A0.uuid, 4),)
    refused = check_extender_decision(Claim("ns/train", "uid-train", "main", slices, rule=required), CARDS, GIB, None)
    assert refused is not None and refused.reason == "card-rule"
    assert refused.message == (
        f"pod ns/train container main: card 0 ({A0.uuid}) doesn't enforce GPU memory limits: {SIMULATED_LIMITS}"
    )
    enforcing = [replace(A0, memory_limits=ENFORCED), A1, T4]
    assert (
        check_extender_decision(Claim("ns/train", "uid-train", "main", slices, rule=required), enforcing, GIB, None)
        is None
    )
    assert check_extender_decision(claim(*slices), CARDS, GIB, None) is None
