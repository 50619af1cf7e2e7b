"""Keys on a pod that gpushare would silently ignore, named with the key it most likely meant."""

from __future__ import annotations

from typing import Any

import pytest

from gpushare.contract import keycheck
from gpushare.contract.keycheck import (
    MAX_COMPARED,
    MAX_NAMED,
    NEAR_MISS_EDITS,
    UnknownKey,
    edit_distance,
    nearest_key,
    unknown_keys,
)
from gpushare.contract.names import (
    ANN_GPU_MODEL,
    ANN_POLICY,
    ANN_REQUIRE_MEMORY_LIMIT,
    KNOWN_POD_ANNOTATIONS,
    KNOWN_POD_LABELS,
    LABEL_GANG,
    RESOURCE_MEM,
)


def pod(annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None, **limits: Any) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "team", "annotations": annotations or {}, "labels": labels or {}},
        "spec": {"containers": [{"name": "main", "resources": {"limits": dict(limits)}}]},
    }


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [
        ("gpu-modle", "gpu-model", 1),  # two neighbours swapped
        ("gpu-mode", "gpu-model", 1),
        ("gpu-modal", "gpu-model", 1),
        ("gpu_modl", "gpu-model", 2),
        ("policy", "policy", 0),
        ("gpu-count", "gpu-mem", NEAR_MISS_EDITS + 1),  # too far: cut short
    ],
)
def test_edit_distance(a: str, b: str, distance: int) -> None:
    assert edit_distance(a, b) == distance
    assert edit_distance(b, a) == distance


def test_the_typo_that_ran_on_the_wrong_card_is_named_with_the_key_it_meant() -> None:
    (found,) = unknown_keys(pod({"gpushare.io/gpu-modle": "A10"}))
    assert found == UnknownKey("annotation", "gpushare.io/gpu-modle", ANN_GPU_MODEL)
    assert (
        found.message() == "gpushare ignores annotation 'gpushare.io/gpu-modle': did you mean 'gpushare.io/gpu-model'?"
    )


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({"gpushare.oi/policy": "spread"}, [("gpushare.oi/policy", ANN_POLICY)]),  # outside the prefix
        ({"gpushare.io/require-memory-limits": "1"}, [("gpushare.io/require-memory-limits", ANN_REQUIRE_MEMORY_LIMIT)]),
        ({"gpushare.io/priority": "high"}, [("gpushare.io/priority", "")]),  # gpushare's prefix, nothing close
        ({"example.com/policy": "x", "kubectl.kubernetes.io/restartedAt": "now"}, []),  # someone else's keys
    ],
)  # fmt: skip
def test_unknown_annotations(annotations: dict[str, str], expected: list[tuple[str, str]]) -> None:
    assert [(k.key, k.nearest) for k in unknown_keys(pod(annotations))] == expected


def test_every_known_key_passes() -> None:
    annotations = dict.fromkeys(KNOWN_POD_ANNOTATIONS, "x")
    labels = dict.fromkeys(KNOWN_POD_LABELS, "x")
    assert unknown_keys(pod(annotations, labels, **{RESOURCE_MEM: 4, "cpu": 1})) == []


def test_labels_and_resources_are_checked_too() -> None:
    found = unknown_keys(pod(labels={"gpushare.io/gnag": "train"}, **{"aliyun.com/gpumem": 4, "aliyun.com/gpu": 1}))
    assert [(k.where, k.key, k.nearest) for k in found] == [
        ("container 'main''s resource", "aliyun.com/gpu", ""),
        ("container 'main''s resource", "aliyun.com/gpumem", RESOURCE_MEM),
        ("label", "gpushare.io/gnag", LABEL_GANG),
    ]
    assert found[0].message().endswith("its resources are aliyun.com/gpu-mem and aliyun.com/gpu-count")


def test_an_update_is_checked_for_the_keys_it_adds() -> None:
    old = pod({"gpushare.io/gpu-modle": "A10"}, **{"aliyun.com/gpumem": 4})
    new = pod({"gpushare.io/gpu-modle": "A10", "gpushare.io/polcy": "spread"}, **{"aliyun.com/gpumem": 4})
    assert [k.key for k in unknown_keys(new, old)] == ["gpushare.io/polcy"]


def test_a_long_key_is_quoted_short() -> None:
    (found,) = unknown_keys(pod({"gpushare.io/" + "x" * 300: "1"}))
    assert len(found.message()) < 200


def test_nearest_key_prefers_the_closest() -> None:
    assert nearest_key("gpushare.io/gang-hol", KNOWN_POD_ANNOTATIONS | KNOWN_POD_LABELS) == "gpushare.io/gang-hold"


def test_a_pod_with_thousands_of_keys_is_checked_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each key compared costs an edit-distance table per known key: a pod can't make the webhook or the
    extender compare thousands (measured: 0.13 s for 10,000 keys, against 13 s uncapped)."""
    near = {f"gpushare.oi/gpu-mo{i:04d}": "x" for i in range(5000)}  # near gpushare's keys, outside its prefix
    typo = {"gpushare.io/gpu-modle": "A10", **{f"gpushare.io/z{i:04d}": "x" for i in range(5000)}}
    found = unknown_keys(pod({**near, **typo}))
    # those under gpushare's prefix first, the typo among them with the key it meant; at most MAX_NAMED
    assert len(found) == MAX_NAMED and all(k.key.startswith("gpushare.io/") for k in found)
    assert UnknownKey("annotation", "gpushare.io/gpu-modle", ANN_GPU_MODEL) in found
    compared: list[str] = []
    real = keycheck.nearest_key
    monkeypatch.setattr(keycheck, "nearest_key", lambda key, known: compared.append(key) or real(key, known))
    unknown_keys(pod(near))
    assert len(compared) == MAX_COMPARED
