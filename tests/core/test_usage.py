"""Per-card usage from pod annotations: what every component uses to refuse over-commitment."""

import pytest
from podfactory import gpu_pod

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.errors import OverClaimError
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import ANN_ALLOCATION, ANN_MEM_IDX, NODE_ANN_PENDING_BINDS, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.pending import LedgerError, PendingBind, format_pending_binds, parse_pending_binds
from gpushare.contract.request import parse_pod_request
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.holdings.node import node_usage
from gpushare.holdings.pod import capped, pod_allocation

CARDS = simulated_cards("n1", "2xA100-80GB:81920,1xT4:15360")
A0, A1, T4 = CARDS
INVENTORY = NodeInventory(GIB, CARDS)


def pod(name, mem, annotations, phase="Pending", count=None):
    main = {
        "name": "main",
        "resources": {"limits": {RESOURCE_MEM: str(mem), **({RESOURCE_COUNT: str(count)} if count else {})}},
    }
    return gpu_pod(name, [main], namespace="ns", uid=f"uid-{name}", phase=phase, extra_annotations=annotations)


def ours(*slices):
    return {ANN_ALLOCATION: format_allocation({"main": tuple(slices)})}


def test_usage_counts_ours_original_and_ignores_finished() -> None:
    pods = [
        pod("a", 8, ours(CardSlice(0, A0.uuid, 8))),
        pod("b", 4, {ANN_MEM_IDX: str(A0.minor)}),  # written by the original extender: a minor number
        pod("c", 10, ours(CardSlice(2, T4.uuid, 10)), phase="Succeeded"),
        pod("d", 20, ours(CardSlice(0, A0.uuid, 10), CardSlice(1, A1.uuid, 10)), count=2),
        pod("e", 2, {}),  # not scheduled by us yet
    ]
    used, counted, bad = node_usage(pods, INVENTORY)
    assert used == {A0.uuid: 22, A1.uuid: 10, T4.uuid: 0}
    assert [p.key for p in counted] == ["ns/a", "ns/b", "ns/d"]
    assert bad == []


def test_bad_annotations_are_reported_not_counted_as_free() -> None:
    pods = [pod("x", 4, {ANN_MEM_IDX: "7"}), pod("y", 4, {ANN_ALLOCATION: "{garbage"})]
    used, counted, bad = node_usage(pods, INVENTORY)
    assert counted == [] and set(used.values()) == {0}
    assert [b.key for b in bad] == ["ns/x", "ns/y"]
    assert "card 7 (a /dev/nvidia minor number) is not on this node" in bad[0].reason
    assert "not valid JSON" in bad[1].reason


def test_a_bogus_card_appended_to_an_allocation_does_not_hide_the_real_one() -> None:
    """A card the node lacks is a problem, and left out: the pod is still counted on the cards it has."""
    gone = CardSlice(3, "GPU-gone", 4)
    pods = [pod("z", 8, ours(CardSlice(0, A0.uuid, 4), gone), count=2), pod("a", 8, ours(CardSlice(0, A0.uuid, 8)))]
    used, counted, bad = node_usage(pods, INVENTORY)
    assert used == {A0.uuid: 12, A1.uuid: 0, T4.uuid: 0}
    assert [p.key for p in counted] == ["ns/z", "ns/a"]
    assert [(b.key, b.reason, b.counted) for b in bad] == [
        ("ns/z", "pod ns/z: card(s) GPU-gone are not on this node", True)
    ]


# --- capping: a pod is counted at its request, never at what its annotation claims ----------------------


def test_an_allocation_claiming_more_than_the_request_counts_at_the_request() -> None:
    pods = [pod("big", 8, ours(CardSlice(0, A0.uuid, 80))), pod("small", 8, ours(CardSlice(1, A1.uuid, 1)))]
    used, _, bad = node_usage(pods, INVENTORY)
    assert used == {A0.uuid: 8, A1.uuid: 8, T4.uuid: 0}
    ((key, reason, was_counted),) = [(b.key, b.reason, b.counted) for b in bad]
    assert key == "ns/big" and was_counted
    assert f"pod ns/big container 'main' card 0 ({A0.uuid}): {ANN_ALLOCATION} claims 80 unit(s), more than the 8" in (
        reason
    )


def test_over_claims_are_a_named_error() -> None:
    request = parse_pod_request(pod("big", 8, {}))
    allocation, problems = capped({"main": (CardSlice(0, A0.uuid, 80),)}, request, INVENTORY, ANN_ALLOCATION)
    assert allocation == {"main": (CardSlice(0, A0.uuid, 8),)}
    (error,) = problems
    assert isinstance(error, OverClaimError)
    assert (error.pod, error.container, error.field, error.claimed, error.requested) == (
        "ns/big", "main", ANN_ALLOCATION, 80, 8,
    )  # fmt: skip


def test_a_whole_card_request_counts_the_whole_card_whatever_the_annotation_says() -> None:
    whole = pod("whole", 0, ours(CardSlice(0, A0.uuid, 1)), count=1)
    whole["spec"]["containers"][0]["resources"]["limits"] = {RESOURCE_COUNT: "1"}
    used, _, _ = node_usage([whole], INVENTORY)
    assert used[A0.uuid] == 80


def test_the_original_index_annotation_is_capped_too() -> None:
    """``ALIYUN_COM_GPU_MEM_IDX`` carries no amount: the pod is counted at its request."""
    used, _, bad = node_usage([pod("b", 4, {ANN_MEM_IDX: str(A0.minor)})], INVENTORY)
    assert used[A0.uuid] == 4 and not bad


def test_an_allocation_for_a_container_that_requests_no_gpu_is_left_out_and_reported() -> None:
    forged = pod("f", 8, {ANN_ALLOCATION: format_allocation({
        "main": (CardSlice(0, A0.uuid, 8),), "sidecar": (CardSlice(1, A1.uuid, 80),),
    })})  # fmt: skip
    forged["spec"]["containers"].append({"name": "sidecar"})
    used, _, bad = node_usage([forged], INVENTORY)
    assert used == {A0.uuid: 8, A1.uuid: 0, T4.uuid: 0}
    assert "names container(s) ['sidecar'] that request no GPU" in bad[0].reason


# --- the ledger: what the extender recorded on the node outranks pod annotations -------------------------


def recorded(key: str, **held: int) -> PendingBind:
    return PendingBind(key, held, 0.0)


def test_a_pod_with_a_ledger_entry_holds_what_it_records_whatever_its_annotation_claims() -> None:
    """A running pod rewrote its allocation from card 0 to card 1: it is still counted on card 0."""
    moved = pod("moved", 40, ours(CardSlice(1, A1.uuid, 40)))
    ledger = {"uid-moved": recorded("ns/moved", **{A0.uuid: 40})}
    used, counted, bad = node_usage([moved], INVENTORY, ledger=ledger)
    assert used == {A0.uuid: 40, A1.uuid: 0, T4.uuid: 0}
    assert counted[0].held == {A0.uuid: 40}
    (report,) = bad
    assert report.counted and report.key == "ns/moved"
    assert f"claim card 1 ({A1.uuid}) 40 unit(s)" in report.reason
    assert f"recorded card 0 ({A0.uuid}) 40 unit(s)" in report.reason and NODE_ANN_PENDING_BINDS in report.reason


def test_a_ledger_entry_counts_only_for_the_pod_with_its_uid() -> None:
    """A pod replaced under the same name is counted from its own annotations, not the old entry."""
    replaced = pod("p", 8, ours(CardSlice(1, A1.uuid, 8)))
    ledger = {"uid-of-the-old-pod": recorded("ns/p", **{A0.uuid: 8})}
    used, _, bad = node_usage([replaced], INVENTORY, ledger=ledger)
    assert used == {A0.uuid: 0, A1.uuid: 8, T4.uuid: 0} and not bad


def test_a_pod_whose_annotations_agree_with_the_ledger_is_not_reported() -> None:
    agreeing = pod("ok", 8, ours(CardSlice(0, A0.uuid, 8)))
    used, _, bad = node_usage([agreeing], INVENTORY, ledger={"uid-ok": recorded("ns/ok", **{A0.uuid: 8})})
    assert used[A0.uuid] == 8 and not bad


def test_a_pod_with_a_ledger_entry_and_unreadable_annotations_is_counted_as_recorded() -> None:
    garbled = pod("g", 8, {ANN_ALLOCATION: "{garbage"})
    used, counted, bad = node_usage([garbled], INVENTORY, ledger={"uid-g": recorded("ns/g", **{A1.uuid: 8})})
    assert used[A1.uuid] == 8 and [p.key for p in counted] == ["ns/g"]
    assert "not valid JSON" in bad[0].reason and "claim no card" in bad[0].reason


def test_the_ledger_annotation_round_trips_and_rejects_garbage() -> None:
    ledger = {"uid-a": PendingBind("ns/a", {A0.uuid: 8}, 1700000000.25)}
    assert parse_pending_binds(format_pending_binds(ledger), "n1") == ledger
    for bad_text in ("[]", '{"u": {"pod": "a"}}', '{"u": {"pod": "a", "held": {"GPU-x": -1}, "at": 1}}'):
        with pytest.raises(LedgerError, match=f"node n1 annotation {NODE_ANN_PENDING_BINDS}"):
            parse_pending_binds(bad_text, "n1")


def test_original_index_resolves_as_a_minor_number_through_the_node_inventory() -> None:
    assert [card.minor for card in CARDS] == [2, 1, 0]  # the simulated minors run backwards
    got = pod_allocation(pod("b", 4, {ANN_MEM_IDX: "2"}), CARDS)
    assert got == {"main": (CardSlice(0, A0.uuid, 4),)}
