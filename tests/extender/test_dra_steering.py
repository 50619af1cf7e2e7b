"""The host entry's scores for a pod whose ResourceClaims kube-scheduler's DRA allocator places: the
extender follows the nodes' ResourceSlices and the allocated claims, and steers the pod to the node
where the allocator's first fit leaves the least memory free on its card."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from gpushare.advertiser.resourceslice import resource_slice
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.verbs import host_prioritize_result
from gpushare.extender.wire import Raw
from podfactory import container, gpu_pod
from support.draclaims import claim, result
from support.extender import host_scores

from gpushare.cards import Card
from gpushare.contract.units import GIB

NAMES = ["empty", "busy", "no-slice"]


def listed(cache: ClusterCache) -> ClusterCache:
    """As if both DRA watches had listed the cluster (their objects are put in with ``apply``)."""
    for watch in (cache.dra.slices, cache.dra.claims):
        watch._synced.set()
    return cache


def slice_of(node: str) -> dict[str, Any]:
    cards = [Card(i, f"GPU-{node}-{i}", "V100", 32768, minor=i) for i in range(2)]
    live = resource_slice(node, cards, GIB, 1)
    live["metadata"]["resourceVersion"] = "1"
    return live


def pending_claim(name: str, memory: str = "8Gi", **exactly: Any) -> dict[str, Any]:
    body = {"deviceClassName": "gpu.gpushare.io", "capacity": {"requests": {"memory": memory}}, **exactly}
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": body}]}}
    return {"metadata": {"namespace": "ns", "name": name, "resourceVersion": "2"}, "spec": spec}


def dra_pod(*claims: str) -> dict[str, Any]:
    pod = gpu_pod("p", [container("main")], node=None, namespace="ns")
    pod["spec"]["resourceClaims"] = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
    return pod


@pytest.fixture
def cache() -> ClusterCache:
    """Two nodes with two 32 GiB DRA cards each, 20 GiB of ``busy``'s card-0 held by a claim; a third
    node without a slice."""
    cache = listed(ClusterCache(None, dra_steering=True))
    for node in ("empty", "busy"):
        cache.dra.slices.apply(slice_of(node))
    cache.dra.claims.apply(claim(result(device="card-0", memory="20Gi", pool="busy"), name="held"))
    return cache


def scores_of(reply: Raw | list[dict[str, Any]]) -> dict[str, int]:
    return host_scores(reply if isinstance(reply, list) else json.loads(reply.text), NAMES)


def scores(cache: ClusterCache, pod: dict[str, Any]) -> dict[str, int]:
    return scores_of(host_prioritize_result(PlacementEngine(cache, "fgdfit"), {"Pod": pod, "NodeNames": NAMES}))


def test_a_dra_pod_goes_where_the_allocator_s_card_is_left_fullest(
    cache: ClusterCache, caplog: pytest.LogCaptureFixture
) -> None:
    cache.dra.claims.apply(pending_claim("want"))
    with caplog.at_level(logging.INFO, logger="gpushare.extender.verbs"):
        assert scores(cache, dra_pod("want")) == {"empty": 0, "busy": 10, "no-slice": 0}
    assert "pod ns/p: node busy scores best of 3, the allocator would take card-0 there (4096 MiB left)" in caplog.text


def test_a_claim_deleted_frees_its_memory_for_the_scores(cache: ClusterCache) -> None:
    cache.dra.claims.apply(pending_claim("want", memory="12Gi"))
    assert scores(cache, dra_pod("want")) == {"empty": 0, "busy": 10, "no-slice": 0}
    held = cache.dra.claims.get("held", "ns")
    assert held is not None
    cache.dra.claims._store("DELETED", held)
    assert scores(cache, dra_pod("want")) == {"empty": 10, "busy": 10, "no-slice": 0}


def test_a_claim_too_big_for_a_node_s_free_cards_scores_zero_there(cache: ClusterCache) -> None:
    cache.dra.claims.apply(pending_claim("two", memory="16Gi", count=2))
    assert scores(cache, dra_pod("two")) == {"empty": 10, "busy": 0, "no-slice": 0}


@pytest.mark.parametrize(
    ("claims", "reason"),
    [
        ([], "ResourceClaim ns/missing is not in the cache yet"),
        ([pending_claim("missing", selectors=[{"cel": {"expression": "true"}}])], "selectors"),
        ([{**pending_claim("missing"), "status": claim(result(pool="empty"))["status"]}], "is allocated already"),
    ],
)
def test_claims_that_can_t_be_predicted_score_zero_everywhere_and_say_why(
    cache: ClusterCache, claims: list[dict[str, Any]], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    for raw in claims:
        cache.dra.claims.apply(raw)
    with caplog.at_level(logging.INFO, logger="gpushare.extender.verbs"):
        assert set(scores(cache, dra_pod("missing")).values()) == {0}
    assert "pod ns/p" in caplog.text and reason in caplog.text


def test_before_the_slices_and_claims_are_listed_a_dra_pod_scores_zero() -> None:
    cache = ClusterCache(None, dra_steering=True)
    cache.dra.slices.apply(slice_of("busy"))
    cache.dra.claims.apply(pending_claim("want"))
    assert set(scores(cache, dra_pod("want")).values()) == {0}


def test_a_pod_whose_claims_ask_other_drivers_is_scored_as_a_pod_without_gpus(cache: ClusterCache) -> None:
    nic = pending_claim("nic", deviceClassName="nic.example.com")
    cache.dra.claims.apply(nic)
    plain = gpu_pod("p", [container("main")], node=None, namespace="ns")
    engine = PlacementEngine(cache, "fgdfit")
    expected = host_prioritize_result(engine, {"Pod": plain, "NodeNames": NAMES})
    assert scores(cache, dra_pod("nic")) == scores_of(expected)
    assert max(scores_of(expected).values()) == 10  # the host policy scored it, not the DRA path's zeros


def test_without_dra_steering_a_dra_pod_is_scored_as_a_pod_without_gpus_and_nothing_is_watched() -> None:
    cache = ClusterCache(None)
    assert cache.dra is None
    engine = PlacementEngine(cache, "fgdfit")
    plain = gpu_pod("p", [container("main")], node=None, namespace="ns")
    expected = host_prioritize_result(engine, {"Pod": plain, "NodeNames": NAMES})
    assert scores(cache, dra_pod("want")) == scores_of(expected)
