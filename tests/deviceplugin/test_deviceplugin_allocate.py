"""The Allocate decision and GetPreferredAllocation, as pure functions over pods and cards."""

from __future__ import annotations

from typing import Any

import pytest
from gpushare.deviceplugin.decision import booked_cards_note, decide, preferred_cards
from gpushare.deviceplugin.devices import card_of_device, device_id
from gpushare.deviceplugin.preferred import preferred_ids
from podfactory import container, gpu_pod, slices

from gpushare.assignment import Refusal
from gpushare.cards import Card
from gpushare.contract.allocation import CardSlice, format_assigned_containers, parse_assigned_containers
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_ASSIGNED_CONTAINERS,
    ANN_GPU_MODEL,
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_IDX,
    ANN_REQUIRE_NVLINK,
    CTR_ANN_CARDS,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD,
    CTR_ANN_POD_UID,
    ENV_MEM_CONTAINER,
    ENV_MEM_DEV,
    ENV_MEM_IDX,
    ENV_MEM_POD,
    ENV_VISIBLE_DEVICES,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.pending import PendingBind
from gpushare.contract.units import GIB, parse_unit
from gpushare.gpus.simulated import simulated_cards
from gpushare.placement import ANY_CARD, CardRule

CARDS = simulated_cards("n1", "2xA100-80GB:81920,1xT4:15360")
A0, A1, T4 = CARDS


def refusal(pods: list[dict[str, Any]], units: int, resource: str = RESOURCE_MEM, cards: list[Card] = CARDS):
    with pytest.raises(Refusal) as refused:
        decide(pods, "n1", resource, units, cards, GIB)
    return refused.value


def test_answer_carries_the_cards_env_and_the_annotations_for_the_cri_shim() -> None:
    pod = gpu_pod(
        "web",
        [container("main", 6), container("side", 2)],
        uid="u-1",
        allocation={"main": slices([A1], 6), "side": slices([T4], 2)},
    )
    decision = decide([pod], "n1", RESOURCE_MEM, 6, CARDS, GIB)
    assert decision.container == "main"
    assert decision.envs == {
        ENV_VISIBLE_DEVICES: A1.uuid,
        ENV_MEM_IDX: "1",
        ENV_MEM_POD: "8",
        ENV_MEM_CONTAINER: "6",
        ENV_MEM_DEV: "80",
        # NVIDIA's toolkit hook, where installed, sets the same 6 GiB cap and no guarantee
        "NVIDIA_GPU_MEMORY_LIMITS": "6144",
        "NVIDIA_GPU_MEMORY_LIMIT": "6144",
        "NVIDIA_GPU_MEMORY_REQUESTS": "0",
        "NVIDIA_GPU_MEMORY_REQUEST": "0",
    }
    assert decision.annotations == {
        CTR_ANN_POD_UID: "u-1",
        CTR_ANN_POD: "default/web",
        CTR_ANN_CONTAINER: "main",
        CTR_ANN_CARDS: A1.uuid,
    }
    recorded = decision.pod_patch["metadata"]["annotations"]
    assert parse_assigned_containers(recorded[ANN_ASSIGNED_CONTAINERS]) == {"main": frozenset({RESOURCE_MEM})}
    assert ANN_MEM_ASSIGNED not in recorded  # "side" is still waiting
    assert decision.usage == {A0.uuid: 0, A1.uuid: 6, T4.uuid: 2}


def test_the_last_container_served_marks_the_pod_assigned() -> None:
    pod = gpu_pod(
        "web",
        [container("main", 6), container("side", 2)],
        allocation={"main": slices([A1], 6), "side": slices([T4], 2)},
    )
    pod["metadata"]["annotations"][ANN_ASSIGNED_CONTAINERS] = format_assigned_containers(
        {"main": frozenset({RESOURCE_MEM})}
    )
    recorded = decide([pod], "n1", RESOURCE_MEM, 2, CARDS, GIB).pod_patch["metadata"]["annotations"]
    assert recorded[ANN_MEM_ASSIGNED] == "true"
    assert set(parse_assigned_containers(recorded[ANN_ASSIGNED_CONTAINERS])) == {"main", "side"}


def test_a_two_card_container_sees_both_cards_and_is_assigned_after_both_resources() -> None:
    pod = gpu_pod("pair", [container("main", 40, 2)], allocation={"main": slices([A0, A1], 20)})
    first = decide([pod], "n1", RESOURCE_COUNT, 2, CARDS, GIB)
    assert first.envs[ENV_VISIBLE_DEVICES] == f"{A0.uuid},{A1.uuid}"
    assert first.envs[ENV_MEM_IDX] == "0,1" and first.envs[ENV_MEM_CONTAINER] == "40"
    assert first.annotations[CTR_ANN_CARDS] == f"{A0.uuid},{A1.uuid}"
    assert ANN_MEM_ASSIGNED not in first.pod_patch["metadata"]["annotations"]
    pod["metadata"]["annotations"].update(first.pod_patch["metadata"]["annotations"])
    second = decide([pod], "n1", RESOURCE_MEM, 40, CARDS, GIB)
    assert second.pod_patch["metadata"]["annotations"][ANN_MEM_ASSIGNED] == "true"


def test_a_pod_with_only_the_original_annotations_gets_its_card_by_minor_number() -> None:
    decision = decide(
        [gpu_pod("legacy", [container("main", 5)], original_index=T4.minor)], "n1", RESOURCE_MEM, 5, CARDS, GIB
    )
    assert decision.envs[ENV_VISIBLE_DEVICES] == T4.uuid and decision.envs[ENV_MEM_DEV] == "15"


def test_units_follow_the_configured_memory_unit() -> None:
    pod = gpu_pod("blocks", [container("main", 3)], allocation={"main": slices([T4], 3)})
    decision = decide([pod], "n1", RESOURCE_MEM, 3, CARDS, parse_unit("4096MiB"))
    assert decision.envs[ENV_MEM_DEV] == "3" and decision.envs[ENV_MEM_CONTAINER] == "3"


def test_over_commit_is_refused_naming_pod_container_card_and_holders() -> None:
    running = gpu_pod("running", [container("main", 10)], allocation={"main": slices([T4], 10)}, phase="Running")
    greedy = gpu_pod("greedy", [container("main", 6)], allocation={"main": slices([T4], 6)})
    refused = refusal([running, greedy], 6)
    assert refused.reason == "overcommit" and not refused.invalid_input
    assert refused.pod is greedy
    message = str(refused)
    assert message.startswith("pod default/greedy container main: card 2 (" + T4.uuid + ") would be over-committed")
    assert "claim 16 of its 15 GiB unit(s)" in message and "default/running (10)" in message


def test_finished_pods_no_longer_hold_their_card() -> None:
    done = gpu_pod("done", [container("main", 10)], allocation={"main": slices([T4], 10)}, phase="Succeeded")
    fits = gpu_pod("fits", [container("main", 6)], allocation={"main": slices([T4], 6)})
    assert decide([done, fits], "n1", RESOURCE_MEM, 6, CARDS, GIB).slices == slices([T4], 6)


def test_an_exclusive_card_is_refused_when_anyone_else_holds_part_of_it() -> None:
    sharing = gpu_pod("sharing", [container("main", 1)], allocation={"main": slices([A0], 1)}, phase="Running")
    whole = gpu_pod("whole", [container("main", count=1)], allocation={"main": slices([A0], 80)})
    assert refusal([sharing, whole], 1, RESOURCE_COUNT).reason == "overcommit"
    assert decide([whole], "n1", RESOURCE_COUNT, 1, CARDS, GIB).envs[ENV_VISIBLE_DEVICES] == A0.uuid


def test_an_exclusive_request_assigned_part_of_a_card_is_bad_input() -> None:
    pod = gpu_pod("half", [container("main", count=1)], allocation={"main": slices([A0], 40)})
    refused = refusal([pod], 1, RESOURCE_COUNT)
    assert refused.invalid_input and "requests card 0" in str(refused) and "whole but is assigned 40" in str(refused)


def test_an_unhealthy_card_is_refused() -> None:
    pod = gpu_pod("sick", [container("main", 2)], allocation={"main": slices([T4], 2)})
    cards = [A0, A1, T4.with_health(False)]
    refused = refusal([pod], 2, cards=cards)
    assert refused.reason == "unhealthy-card"
    assert str(refused) == f"pod default/sick container main: assigned card 2 ({T4.uuid}) is unhealthy"


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({ANN_MEM_IDX: "two"}, "annotation ALIYUN_COM_GPU_MEM_IDX: 'two' is not an integer"),
        ({ANN_MEM_IDX: "7"}, "card 7 (a /dev/nvidia minor number) is not on this node"),
        ({ANN_MEM_IDX: "-1"}, "-1 is negative"),
        (
            {ANN_MEM_ASSUME_TIME: "1"},
            "has none of gpushare.io/allocation, scheduler.framework.gpushare.allocation or ALIYUN_COM_GPU_MEM_IDX",
        ),
        ({ANN_ALLOCATION: "{garbage", ANN_MEM_IDX: "0"}, "annotation gpushare.io/allocation: not valid JSON"),
        ({ANN_ALLOCATION: '{"main": [{"index": 0, "uuid": "GPU-x"}]}'}, "units None on card 0"),
        ({ANN_ALLOCATION: '{"main": [{"index": "0", "uuid": "GPU-x", "units": 3}]}'}, "card index '0'"),
        ({ANN_ALLOCATION: '{"other": [{"index": 0, "uuid": "GPU-x", "units": 3}]}'}, "['other'] that request no GPU"),
    ],
    ids=[
        "non-integer",
        "out-of-range",
        "negative",
        "missing-index",
        "garbage-json",
        "no-units",
        "string-index",
        "wrong-container",
    ],
)
def test_bad_annotations_are_refused_as_invalid_input_naming_pod_and_container(
    annotations: dict[str, str], message: str
) -> None:
    pod = gpu_pod("bad", [container("main", 3)], extra_annotations=annotations)
    refused = refusal([pod], 3)
    assert refused.invalid_input and refused.reason == "bad-annotation"
    assert str(refused).startswith("pod default/bad container main: ")
    assert message in str(refused)


def test_an_annotation_naming_a_card_by_the_wrong_index_is_refused() -> None:
    pod = gpu_pod("mixed-up", [container("main", 3)], allocation={"main": (CardSlice(0, T4.uuid, 3),)})
    assert f"assigned card {T4.uuid} is index 2 here, not 0" in str(refusal([pod], 3))


def test_a_card_of_another_node_is_refused() -> None:
    alien = CardSlice(0, "GPU-00000000-0000-0000-0000-000000000000", 3)
    refused = refusal([gpu_pod("alien", [container("main", 3)], allocation={"main": (alien,)})], 3)
    assert refused.reason == "unknown-card" and "is not on this node" in str(refused)


def test_no_matching_pod_is_refused_with_the_request_and_node() -> None:
    refused = refusal([gpu_pod("p", [container("main", 3)], original_index=2)], 4)
    assert refused.reason == "no-pending-pod" and refused.pod is None
    assert "aliyun.com/gpu-mem x4: no pending pod on node n1" in str(refused)


def test_preferred_cards_are_the_scheduler_choice_for_the_container_that_would_match() -> None:
    pod = gpu_pod("pair", [container("main", 40, 2)], allocation={"main": slices([A1, T4], 20)})
    assert preferred_cards([pod], "n1", RESOURCE_COUNT, 2, CARDS) == ((A1.uuid, T4.uuid), ANY_CARD)
    assert preferred_cards([pod], "n1", RESOURCE_COUNT, 3, CARDS) == ((), ANY_CARD)


def test_gpu_count_preference_is_one_replica_of_each_scheduler_card_then_nvlink_then_numa() -> None:
    eight = simulated_cards("n1", "4xA100:81920,4xT4:15360")  # NUMA 0: A100 x4 (NVLinked), NUMA 1: T4 x4
    uuids = [card.uuid for card in eight]
    replicas = [device_id(u, n) for u in uuids for n in range(3)]
    chosen = [uuids[5], uuids[6]]
    assert preferred_ids(RESOURCE_COUNT, replicas, [], 2, chosen, eight) == [device_id(u, 0) for u in chosen]
    # replicas already booked are skipped, but never two replicas of one card while others are free
    free = [d for d in replicas if d != device_id(uuids[5], 0)]
    assert preferred_ids(RESOURCE_COUNT, free, [], 2, chosen, eight) == [
        device_id(uuids[5], 1),
        device_id(uuids[6], 0),
    ]
    # nothing chosen: an NVLink-connected pair rather than two unrelated cards
    some = [device_id(uuids[i], n) for i in (0, 4, 2) for n in range(2)]
    picked = preferred_ids(RESOURCE_COUNT, some, [], 2, [], eight)
    assert sorted(card_of_device(d) for d in picked) == sorted([uuids[0], uuids[2]])
    # must-include devices are always kept, and the rest come from other cards
    kept = preferred_ids(RESOURCE_COUNT, replicas, [device_id(uuids[5], 2)], 2, chosen, eight)
    assert kept == [device_id(uuids[5], 2), device_id(uuids[6], 0)]
    # fewer distinct cards than asked (kubelet's books differ): still a full answer
    assert len(preferred_ids(RESOURCE_COUNT, [device_id(uuids[0], n) for n in range(3)], [], 2, [], eight)) == 2


def test_kubelet_booking_replicas_of_other_cards_is_noted_not_refused() -> None:
    assigned = slices([A1, T4], 20)
    assert booked_cards_note(RESOURCE_COUNT, [device_id(T4.uuid, 3), device_id(A1.uuid, 0)], assigned) is None
    note = booked_cards_note(RESOURCE_COUNT, [device_id(A0.uuid, 0), device_id(T4.uuid, 1)], assigned)
    assert note is not None and A0.uuid in note and f"card {A1.index} ({A1.uuid})" in note
    assert booked_cards_note(RESOURCE_MEM, [device_id(A0.uuid, 0)], assigned) is None


def test_gpu_mem_preference_takes_units_of_the_scheduler_card_first() -> None:
    available = [device_id(card.uuid, n) for card in CARDS for n in range(3)]
    picked = preferred_ids(RESOURCE_MEM, available, [], 3, [T4.uuid], CARDS)
    assert picked == [device_id(T4.uuid, n) for n in range(3)]


def test_preferred_pick_keeps_the_matched_pods_card_rule() -> None:
    # NUMA 0: A100 x2 (NVLinked), NUMA 1: T4 x2 (NVLinked); the pod has no cards chosen yet
    four = simulated_cards("n1", "2xA100-80GB:81920,2xT4:15360")
    a0, a1, t0, t1 = (c.uuid for c in four)
    one_each = [device_id(u, 0) for u in (a1, t0, t1)]
    anything = preferred_ids(RESOURCE_COUNT, one_each, [], 2, [], four)
    assert {card_of_device(d) for d in anything} == {t0, t1}
    a100 = CardRule(models=frozenset({"A100"}))
    # only one A100 offered: never a T4 beside it, kubelet completes the set itself
    assert preferred_ids(RESOURCE_COUNT, one_each, [], 2, [], four, a100) == [device_id(a1, 0)]
    nvlink = CardRule(nvlink=True)
    mixed = [device_id(u, 0) for u in (a0, t0)]
    assert preferred_ids(RESOURCE_COUNT, mixed, [], 2, [], four) == mixed  # any two will do
    assert preferred_ids(RESOURCE_COUNT, mixed, [], 2, [], four, nvlink) == []  # no NVLink pair offered
    # a card kubelet must include: the rest joins it over NVLink
    kept = preferred_ids(RESOURCE_COUNT, [device_id(u, 0) for u in (a0, a1, t0)], [device_id(t0, 0)], 2, [], four,
                         CardRule(same_numa=True))  # fmt: skip
    assert kept == [device_id(t0, 0)]


def test_preferred_cards_carries_the_matched_pods_rule() -> None:
    pod = gpu_pod("pair", [container("main", 0, 2)], allocation={"main": slices([A0, A1], 80)})
    pod["metadata"]["annotations"][ANN_REQUIRE_NVLINK] = "true"
    assert preferred_cards([pod], "n1", RESOURCE_COUNT, 2, CARDS) == ((A0.uuid, A1.uuid), CardRule(nvlink=True))


def test_allocate_refuses_a_card_of_a_model_the_pod_refuses() -> None:
    pod = gpu_pod("a100-only", [container("main", 6)], allocation={"main": slices([T4], 6)})
    pod["metadata"]["annotations"][ANN_GPU_MODEL] = "A100-80GB"
    refused = refusal([pod], 6)
    assert refused.reason == "card-rule" and not refused.invalid_input
    assert f"card {T4.index} ({T4.uuid}) is a T4 card; the pod takes only A100-80GB cards" in str(refused)
    pod["metadata"]["annotations"][ANN_GPU_MODEL] = "A100-80GB|T4"
    assert decide([pod], "n1", RESOURCE_MEM, 6, CARDS, GIB).slices == slices([T4], 6)
    pod["metadata"]["annotations"][ANN_GPU_MODEL] = "|"
    bad = refusal([pod], 6)
    assert bad.invalid_input and f"pod default/a100-only annotation {ANN_GPU_MODEL}: names no card model" in str(bad)


# --- the node's ledger outranks pod annotations --------------------------------------------------------


def test_a_pod_that_moved_its_allocation_still_holds_its_recorded_card() -> None:
    """A running pod rewrote its allocation from card 0 to card 1: a second whole-card pod bound to card 0
    is refused there, because the ledger still says card 0 is taken."""
    mover = gpu_pod("mover", [container("main", 80)], uid="u-mover", allocation={"main": slices([A1], 80)},
                    phase="Running")  # fmt: skip
    second = gpu_pod("second", [container("main", 80)], uid="u-second", allocation={"main": slices([A0], 80)})
    ledger = {"u-mover": PendingBind("default/mover", {A0.uuid: 80}, 0.0)}
    with pytest.raises(Refusal) as refused:
        decide([mover, second], "n1", RESOURCE_MEM, 80, CARDS, GIB, ledger)
    assert refused.value.reason == "overcommit" and "default/mover (80)" in str(refused.value)
    # without the ledger, the forged annotation would have freed card 0
    assert decide([mover, second], "n1", RESOURCE_MEM, 80, CARDS, GIB).container == "main"


def test_allocate_refuses_a_container_whose_annotation_disagrees_with_the_ledger() -> None:
    forger = gpu_pod("forger", [container("main", 8)], uid="u-forger", allocation={"main": slices([A1], 8)})
    ledger = {"u-forger": PendingBind("default/forger", {A0.uuid: 8}, 0.0)}
    with pytest.raises(Refusal) as refused:
        decide([forger], "n1", RESOURCE_MEM, 8, CARDS, GIB, ledger)
    assert refused.value.reason == "ledger-mismatch" and refused.value.invalid_input
    assert refused.value.pod is forger
    message = str(refused.value)
    assert f"claim card 1 ({A1.uuid}) 8 unit(s)" in message and f"recorded card 0 ({A0.uuid}) 8 unit(s)" in message
    assert message.startswith("pod default/forger container main:")
