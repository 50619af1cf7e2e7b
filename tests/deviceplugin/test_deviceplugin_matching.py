"""Which pending container an Allocate call is for: deterministic, per container, per resource."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from gpushare.deviceplugin.matching import fully_served, match_container
from podfactory import container, gpu_pod, slices

from gpushare.contract import names
from gpushare.contract.allocation import format_assigned_containers
from gpushare.contract.errors import AnnotationError, ContractError
from gpushare.contract.request import parse_pod_request
from gpushare.gpus.simulated import simulated_cards

A0, A1, T4 = simulated_cards("n1", "2xA100-80GB:81920,1xT4:15360")


def matched(pods: list[dict[str, Any]], units: int, resource: str = names.RESOURCE_MEM) -> tuple[str, str] | None:
    match = match_container(pods, "n1", resource, units)
    return None if match is None else (match.request.name, match.container.name)


def served(pod: dict[str, Any], by_container: dict[str, set[str]]) -> dict[str, Any]:
    pod["metadata"]["annotations"][names.ANN_ASSIGNED_CONTAINERS] = format_assigned_containers(
        {name: frozenset(res) for name, res in by_container.items()}
    )
    return pod


def test_earliest_assume_time_wins_whatever_the_listing_order() -> None:
    pods = [
        gpu_pod(name, [container("main", 8)], allocation={"main": slices([card], 8)}, assume_ns=ns, uid=name)
        for name, card, ns in (("late", A0, 3000), ("early", A1, 1000), ("middle", T4, 2000))
    ]
    for order in itertools.permutations(pods):
        assert matched(list(order), 8) == ("early", "main")


def test_equal_assume_times_fall_back_to_creation_time_then_uid() -> None:
    def pod(name: str, created: str, uid: str) -> dict[str, Any]:
        return gpu_pod(name, [container("main", 2)], original_index=2, assume_ns=5, uid=uid, created=created)

    newer = pod("newer", "2026-01-02T00:00:00Z", "a")
    older_b = pod("older-b", "2026-01-01T00:00:00Z", "b")
    older_c = pod("older-c", "2026-01-01T00:00:00Z", "c")
    for order in itertools.permutations([newer, older_c, older_b]):
        assert matched(list(order), 2) == ("older-b", "main")


def test_pods_without_an_assume_time_come_after_those_with_one() -> None:
    placed_elsewhere = gpu_pod("other", [container("main", 2)], uid="a", extra_annotations={names.ANN_MEM_IDX: "2"})
    ours = gpu_pod("ours", [container("main", 2)], original_index=2, assume_ns=10**18, uid="b")
    assert matched([placed_elsewhere, ours], 2) == ("ours", "main")


def test_init_containers_first_then_containers_in_spec_order() -> None:
    pod = gpu_pod(
        "multi",
        [container("one", 4), container("two", 4)],
        init=[container("setup", 4)],
        allocation={"setup": slices([T4], 4), "one": slices([A0], 4), "two": slices([A1], 4)},
    )
    assert matched([pod], 4) == ("multi", "setup")
    assert matched([served(pod, {"setup": {names.RESOURCE_MEM}})], 4) == ("multi", "one")
    assert matched([served(pod, {"setup": {names.RESOURCE_MEM}, "one": {names.RESOURCE_MEM}})], 4) == ("multi", "two")


def test_the_request_size_selects_the_container_whose_limit_it_is() -> None:
    pod = gpu_pod(
        "sizes",
        [container("small", 2), container("big", 6)],
        allocation={"small": slices([T4], 2), "big": slices([A0], 6)},
    )
    assert matched([pod], 6) == ("sizes", "big")
    assert matched([pod], 2) == ("sizes", "small")
    assert matched([pod], 8) is None


def test_each_resource_is_served_separately_for_a_container_asking_for_both() -> None:
    pod = gpu_pod("pair", [container("main", 40, 2)], allocation={"main": slices([A0, A1], 20)})
    served(pod, {"main": {names.RESOURCE_MEM}})
    assert matched([pod], 40) is None
    assert matched([pod], 2, names.RESOURCE_COUNT) == ("pair", "main")
    request = parse_pod_request(pod)
    assert not fully_served(request, {"main": frozenset({names.RESOURCE_MEM})})
    assert fully_served(request, {"main": frozenset(names.RESOURCES)})


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p["spec"].update(nodeName="n2"),
        lambda p: p.update(status={"phase": "Running"}),
        lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"),
        lambda p: p["metadata"]["annotations"].update({names.ANN_MEM_ASSIGNED: "true"}),
        lambda p: p["metadata"].update(annotations={}),
    ],
    ids=["other-node", "running", "deleting", "already-assigned", "not-scheduled-by-gpushare"],
)
def test_pods_not_awaiting_allocation_on_this_node_never_match(change: Any) -> None:
    pod = gpu_pod("p", [container("main", 3)], original_index=2)
    change(pod)
    assert matched([pod], 3) is None


def test_a_pod_with_only_the_original_annotations_matches() -> None:
    pod = gpu_pod("legacy", [container("main", 6)], original_index=2)
    assert names.ANN_ALLOCATION not in pod["metadata"]["annotations"]
    assert matched([pod], 6) == ("legacy", "main")


@pytest.mark.parametrize(
    ("annotation", "value", "message"),
    [
        (names.ANN_MEM_ASSUME_TIME, "yesterday", "'yesterday' is not integer nanoseconds"),
        (names.ANN_ASSIGNED_CONTAINERS, "{oops", "not valid JSON"),
        (names.ANN_ASSIGNED_CONTAINERS, '{"main": ["nvidia.com/gpu"]}', "list of gpushare resources"),
    ],
)
def test_a_malformed_annotation_on_the_pod_that_would_match_is_an_error_naming_it(
    annotation: str, value: str, message: str
) -> None:
    pod = gpu_pod("bad", [container("main", 3)], original_index=2, extra_annotations={annotation: value})
    with pytest.raises(AnnotationError) as error:
        match_container([pod], "n1", names.RESOURCE_MEM, 3)
    assert "pod default/bad" in str(error.value) and annotation in str(error.value) and message in str(error.value)


def test_an_unreadable_pod_does_not_block_others_and_is_named_when_nothing_matches() -> None:
    broken = gpu_pod("broken", [container("main", 3)], original_index=2, uid="a", assume_ns=1)
    broken["spec"]["containers"][0]["resources"]["limits"][names.RESOURCE_MEM] = "3.5"
    fine = gpu_pod("fine", [container("main", 3)], original_index=2, uid="b", assume_ns=2)
    assert matched([broken, fine], 3) == ("fine", "main")
    with pytest.raises(ContractError) as error:
        match_container([broken], "n1", names.RESOURCE_MEM, 3)
    assert "pod default/broken container main" in str(error.value) and "'3.5'" in str(error.value)


def test_a_pending_pod_with_an_unreadable_assume_time_only_hurts_itself() -> None:
    """It would come first by creation, and the others of its size are still served; it rides along on
    the match so that it can be told (an Event)."""
    bad = gpu_pod("bad", [container("main", 3)], original_index=0, uid="a", created="2024-01-01T00:00:00Z")
    bad["metadata"]["annotations"][names.ANN_MEM_ASSUME_TIME] = "x"
    good = gpu_pod("good", [container("main", 3)], original_index=1, uid="b", created="2024-01-02T00:00:00Z")
    match = match_container([bad, good], "n1", names.RESOURCE_MEM, 3)
    assert match is not None and match.request.name == "good"
    assert [(s.pod["metadata"]["name"], "'x' is not integer nanoseconds" in s.reason) for s in match.skipped] == [
        ("bad", True)
    ]
