"""Trace pods as kube-scheduler gets them through the extender and through DRA, and the figures a placement
leaves on the cards (``benchmarks/dra_replay.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client
from podfactory import container, gpu_pod
from support.realapi import dra_api_server

from gpushare.contract.allocation import CardSlice
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import DRA_DRIVER, NODE_ANN_INVENTORY, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.simulate.kubereplay import (
    CardLoad,
    GpuAsk,
    ReplayError,
    Share,
    arrivals,
    dra_claim_spec,
    dra_shares,
    extender_limits,
    extender_shares,
    gpu_ask,
    median_ask,
    outcome,
)
from gpushare.simulate.replay import arrival_order
from gpushare.simulate.trace import TracePod

#: the three card sizes of a mixed cluster, in GiB: T4, V100-32GB, A100-80GB
SIZES = (15, 32, 80)


def trace_pod(name: str, num_gpu: int, milli: int) -> TracePod:
    return TracePod(name, 1000, 1024, num_gpu, milli if num_gpu else 0)


def claim(ask: GpuAsk) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": ask.pod, "namespace": "default"},
        "spec": dra_claim_spec(ask, SIZES),
    }


# --- asks ----------------------------------------------------------------------------------------------


def test_a_share_of_a_card_becomes_whole_gib_of_the_reference_card_rounded_up() -> None:
    assert gpu_ask(trace_pod("p", 1, 470), 32) == GpuAsk("p", 1, 16)  # 15.04 GiB
    assert gpu_ask(trace_pod("p", 1, 500), 32) == GpuAsk("p", 1, 16)
    assert gpu_ask(trace_pod("p", 1, 5), 32) == GpuAsk("p", 1, 1)
    assert gpu_ask(trace_pod("p", 2, 250), 16) == GpuAsk("p", 2, 4)


def test_whole_cards_stay_whole_cards_of_any_size() -> None:
    assert gpu_ask(trace_pod("p", 1, 1000), 32) == GpuAsk("p", 1)
    assert gpu_ask(trace_pod("p", 8, 1000), 32).whole


def test_a_pod_without_a_gpu_is_refused_by_name() -> None:
    with pytest.raises(ReplayError, match="pod cpu-only"):
        gpu_ask(trace_pod("cpu-only", 0, 0), 32)


def test_arrivals_are_the_gpu_pods_in_the_papers_order_for_the_seed() -> None:
    pods = [trace_pod(f"p{i:02d}", i % 3, 300) for i in range(30)]
    gpu = [p for p in pods if p.num_gpu]
    asks = arrivals(pods, 5, 7, 32)
    assert [a.pod for a in asks] == [p.name for p in arrival_order(gpu, 7, 0)[:5]]
    assert arrivals(pods, 5, 7, 32) == asks
    assert [a.pod for a in arrivals(pods, 5, 8, 32)] != [a.pod for a in asks]


def test_asking_for_more_pods_than_the_trace_has_is_an_error() -> None:
    with pytest.raises(ReplayError, match="2 GPU pods, fewer than the 3"):
        arrivals([trace_pod("a", 1, 100), trace_pod("b", 1, 1000), trace_pod("c", 0, 0)], 3, 1, 32)


# --- how each way asks ----------------------------------------------------------------------------------


def test_the_extender_gets_the_limits_users_write() -> None:
    assert extender_limits(GpuAsk("p", 1, 16)) == {RESOURCE_MEM: "16"}
    assert extender_limits(GpuAsk("p", 2)) == {RESOURCE_COUNT: "2"}
    assert extender_limits(GpuAsk("p", 2, 8)) == {RESOURCE_MEM: "16", RESOURCE_COUNT: "2"}


def test_a_dra_share_asks_the_drivers_memory_capacity() -> None:
    (request,) = dra_claim_spec(GpuAsk("p", 1, 16), SIZES)["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": DRA_DRIVER, "capacity": {"requests": {"memory": "16Gi"}}}
    (several,) = dra_claim_spec(GpuAsk("p", 2, 8), SIZES)["devices"]["requests"]
    assert several["exactly"]["count"] == 2 and several["exactly"]["allocationMode"] == "ExactCount"


def test_a_dra_whole_card_claim_asks_all_of_a_card_of_each_size_smallest_first() -> None:
    (request,) = dra_claim_spec(GpuAsk("p", 2), (80, 15, 32, 15))["devices"]["requests"]
    subrequests = request["firstAvailable"]
    assert [s["capacity"]["requests"]["memory"] for s in subrequests] == ["15Gi", "32Gi", "80Gi"]
    assert {s["count"] for s in subrequests} == {2}
    assert 'quantity("15Gi")) == 0' in subrequests[0]["selectors"][0]["cel"]["expression"]
    (largest,) = dra_claim_spec(GpuAsk("p", 1), (15, 80, 32), largest_first=True)["devices"]["requests"]
    assert [s["name"] for s in largest["firstAvailable"]] == ["whole-80gi", "whole-32gi", "whole-15gi"]


def test_a_whole_card_claim_needs_one_to_eight_card_sizes() -> None:
    for sizes in ((), range(1, 10)):
        with pytest.raises(ReplayError, match="pod p: a whole-card claim"):
            dra_claim_spec(GpuAsk("p", 1), sizes)


@pytest.mark.parametrize("ask", [GpuAsk("share", 1, 16), GpuAsk("shares", 2, 8), GpuAsk("whole", 2)], ids=str)
def test_the_claims_are_valid_resource_claims_of_kubernetes_1_37(ask: GpuAsk) -> None:
    kubernetes_validate.validate(claim(ask), "1.37", strict=True)


@pytest.fixture(scope="module")
def real_api() -> Iterator[client.ApiClient]:
    with dra_api_server() as api:
        yield api


def test_the_api_server_accepts_the_claims_and_compiles_their_selectors(real_api: client.ApiClient) -> None:
    for ask in (GpuAsk("share", 1, 16), GpuAsk("whole", 2)):
        client.ResourceV1Api(real_api).create_namespaced_resource_claim("default", claim(ask), dry_run="All")


# --- reading what pods hold -------------------------------------------------------------------------------


def test_the_extender_record_is_read_per_pod_and_card_in_gib() -> None:
    cards = simulated_cards("n1", "2xV100:32768")
    node = {"metadata": {"name": "n1", "annotations": {NODE_ANN_INVENTORY: format_inventory(cards, GIB)}}}
    pods = [
        gpu_pod("share", [container("main", mem=8)], allocation={"main": (CardSlice(0, cards[0].uuid, 8),)}),
        gpu_pod("whole", [container("main", count=1)], allocation={"main": (CardSlice(1, cards[1].uuid, 32),)}),
        gpu_pod("pending", [container("main", mem=4)], node=None),
    ]
    held = extender_shares([node], pods)
    assert {pod: [(s.node, s.index, s.gib) for s in shares] for pod, shares in held.items()} == {
        "share": [("n1", 0, 8)],
        "whole": [("n1", 1, 32)],
    }


def allocated(name: str, *results: tuple[str, str, str]) -> dict[str, Any]:
    """A claim as the API server returns it once kube-scheduler allocated it: (pool, device, memory) each."""
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": DRA_DRIVER,
                            "pool": pool,
                            "device": device,
                            "consumedCapacity": {"memory": memory},
                            "shareID": "s",
                        }
                        for pool, device, memory in results
                    ]
                }
            }
        },
    }


def test_dra_claims_are_read_per_pod_and_card_in_gib() -> None:
    claims = [
        allocated("share", ("n1", "card-0", "26Gi")),
        allocated("whole", ("n2", "card-1", "80Gi"), ("n2", "card-3", "80Gi")),
        {"metadata": {"name": "pending", "namespace": "default", "uid": "u"}, "status": {}},
    ]
    held = dra_shares(claims)
    assert {pod: [(s.node, s.index, s.gib) for s in shares] for pod, shares in held.items()} == {
        "share": [("n1", 0, 26)],
        "whole": [("n2", 1, 80), ("n2", 3, 80)],
    }


def test_a_claim_holding_part_of_a_gib_or_a_device_of_another_name_is_an_error() -> None:
    with pytest.raises(ReplayError, match=r"share .*: 1610612736 bytes is not a whole number of GiB"):
        dra_shares([allocated("share", ("n1", "card-0", "1536Mi"))])
    with pytest.raises(ReplayError, match="gpu0"):
        dra_shares([allocated("share", ("n1", "gpu0", "1Gi"))])


# --- the figures ----------------------------------------------------------------------------------------


def cluster() -> dict[str, list[Any]]:
    return {"a": simulated_cards("a", "2xV100:32768"), "b": simulated_cards("b", "1xT4:15360")}


def test_the_figures_of_a_placement() -> None:
    asks = [GpuAsk("s", 1, 26), GpuAsk("w", 1), GpuAsk("t", 1, 4), GpuAsk("late", 1, 30)]
    shares = {
        "s": [Share("a", 0, 26)],
        "w": [Share("a", 1, 32)],
        "t": [Share("b", 0, 4)],
    }
    out = outcome(cluster(), shares, asks, {"s", "w", "t"})
    assert [a.pod for a in out.pending] == ["late"]
    assert (out.allocated_gib, out.allocated_percent) == (62, pytest.approx(100 * 62 / 79))
    assert out.whole_cards == {32: 1}
    assert out.allocated_card_percent == pytest.approx(100 * (26 / 32 + 1 + 4 / 15) / 3)
    assert (out.empty_cards, out.partly_used_cards, out.free_on_partly_used) == (0, 2, 6 + 11)
    # 6 GiB free on card a/0 and 11 on b/0: neither holds 30 GiB, nor a whole card
    assert out.unusable_for(GpuAsk("x", 1, 30)) == 17
    assert out.unusable_for(GpuAsk("x", 1, 8)) == 6
    assert out.unusable_for(GpuAsk("x", 1)) == 17


def test_an_over_committed_card_or_a_bound_pod_holding_nothing_is_an_error() -> None:
    asks = [GpuAsk("s", 1, 26), GpuAsk("u", 1, 8)]
    with pytest.raises(ReplayError, match="node a card 0: 34 GiB held of 32"):
        outcome(cluster(), {"s": [Share("a", 0, 26)], "u": [Share("a", 0, 8)]}, asks, {"s", "u"})
    with pytest.raises(ReplayError, match="pod u is bound but holds no card"):
        outcome(cluster(), {"s": [Share("a", 0, 26)]}, asks, {"s", "u"})
    with pytest.raises(ReplayError, match="pod u holds 8 GiB of node a card 1 unbound"):
        outcome(cluster(), {"s": [Share("a", 0, 26)], "u": [Share("a", 1, 8)]}, asks, {"s"})
    with pytest.raises(ReplayError, match="node c card 0, which the cluster doesn't have"):
        outcome(cluster(), {"s": [Share("c", 0, 26)]}, asks[:1], {"s"})


def test_the_median_ask_ranks_whole_cards_above_any_share() -> None:
    assert median_ask([]) is None
    asks = [GpuAsk("w", 1), GpuAsk("big", 1, 26), GpuAsk("small", 1, 4), GpuAsk("w2", 2)]
    assert median_ask(asks) == GpuAsk("big", 1, 26)
    assert median_ask(asks[:1] + asks[3:]) == GpuAsk("w", 1)


def test_a_card_holds_a_whole_card_ask_only_when_empty() -> None:
    assert CardLoad("a", 0, 32, 0).holds(GpuAsk("w", 1))
    assert not CardLoad("a", 0, 80, 1).holds(GpuAsk("w", 1))
    assert CardLoad("a", 0, 80, 1).holds(GpuAsk("s", 1, 79))
