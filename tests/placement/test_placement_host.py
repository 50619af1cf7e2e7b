"""The host-aware policy (fgdfit): CPU and memory strand GPUs (when a typical pod no longer fits, and
beyond what they can feed at the typical pods' rate), pods without GPUs go where GPUs are taken,
equal placements keep to a fixed node order; the extender's CPU view and host prioritize verb; and the
replay's model of kube-scheduler's own scoring for pods without GPUs."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from gpushare.extender.asks import host_request
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.verbs import host_prioritize_result, prioritize_result
from gpushare.extender.wire import Raw
from podfactory import container, gpu_pod
from support.extender import host_scores

from gpushare.cards import Card
from gpushare.contract.allocation import CardSlice
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY
from gpushare.contract.units import GIB
from gpushare.placement import ANY_CARD, CardRule, Fgd, FgdFit, NodeHosts, Shape, batch_costs, node_order
from gpushare.simulate.product import HOST_WEIGHT, kube_default_scores
from gpushare.simulate.replay import ClusterState
from gpushare.simulate.trace import TraceNode, TracePod

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GiB = 1 << 30
_versions = itertools.count(1)


def policy() -> FgdFit:
    # typical pods: half a card with 8 CPUs, or a whole card with 4 CPUs; and some without GPUs
    return FgdFit.of(
        [(Shape(500), 8000, 0, ANY_CARD)] * 3
        + [(Shape(0, 1, exclusive=True), 4000, 0, ANY_CARD)]
        + [(Shape(0, 0), 1000, 0, ANY_CARD)]
    )


def costs(free: list[list[int]], cpu: list[int], shape: Shape, request: int, names: list[str] | None = None):
    free_arr = np.array(free)
    names = names or [f"n{i}" for i in range(len(free))]
    host = NodeHosts(np.array(cpu), np.full(len(free), 1 << 40), node_order(names))
    return batch_costs(policy(), np.full_like(free_arr, 1000), free_arr, shape, host, (request, 0))


def test_typical_shapes_are_weighed_by_how_often_they_arrive_and_pods_without_gpus_weigh_nothing() -> None:
    assert dict(zip(policy().workload.shapes, policy().workload.counts, strict=True)) == {
        Shape(500): 3,
        Shape(0, 1, exclusive=True): 1,
        Shape(0, 0): 0,
    }
    assert FgdFit.of([(Shape(0, 0), 1000, 0, ANY_CARD)] * 5).workload is None


def test_a_pod_avoids_the_node_whose_cpu_it_would_exhaust() -> None:
    # same cards; on node 0 the pod's 6 CPUs leave 2, too few for any typical pod: its 3 idle cards strand
    cost = costs([[1000, 1000, 1000, 1000]] * 2, [8000, 64000], Shape(500), 6000)
    assert cost[1] < cost[0]


def test_idle_cards_the_free_cpu_cannot_feed_at_the_typical_rate_are_stranded() -> None:
    # the typical GPU pods take 28 CPUs per 2.5 cards: 11.2 CPUs a card
    workload = policy().workload
    idle, card = np.array([4000.0, 4000.0, 0.0]), np.full(3, 1000.0)
    stranded = workload.stranded(idle, card, np.array([22400, 200000, 0]), np.full(3, 1 << 40))
    assert stranded.tolist() == pytest.approx([2000, 0, 0])


def test_a_cpu_hungry_pod_takes_the_node_with_cpu_to_spare_whichever_node_that_is() -> None:
    # the same four idle cards; 30 CPUs feed fewer than 3 typical cards, 200 all of them
    free = [[1000] * 4] * 2
    assert np.argmin(costs(free, [30000, 200000], Shape(500), 16000)) == 1
    assert np.argmin(costs(free, [200000, 30000], Shape(500), 16000)) == 0


def test_taking_gpu_that_the_cpu_had_stranded_already_earns_nothing() -> None:
    # a GPU-hungry pod on the CPU-short node feeds a card that was stranded; that isn't worth a step
    free = [[1000] * 4] * 2
    short, ample = costs(free, [30000, 200000], Shape(0, 1, exclusive=True), 1000)
    assert math.floor(short) == math.floor(ample)


def test_a_pod_that_takes_any_model_leaves_the_cards_other_pods_can_only_use_to_them() -> None:
    # most typical pods accept only T4 cards; a pod that takes any model goes to the other node
    t4_only = CardRule(frozenset({"T4"}))
    fit = FgdFit.of([(Shape(500), 4000, 0, t4_only)] * 3 + [(Shape(500), 4000, 0, ANY_CARD)])
    capacity = np.full((2, 2), 1000)
    for t4 in (0, 1):
        card_models = np.array([[0, 0], [1, 1]]) if t4 == 0 else np.array([[1, 1], [0, 0]])
        hosts = NodeHosts(np.full(2, 64000), np.full(2, 1 << 40), node_order(["a", "b"]), card_models, ("T4", "G2"))
        cost = batch_costs(fit, capacity, capacity.copy(), Shape(500), hosts, (4000, 0))
        assert np.argmin(cost) == 1 - t4


def test_a_pod_without_gpus_goes_where_the_gpus_are_taken_and_strands_none() -> None:
    free = [[1000, 1000], [0, 0], [0, 500], [1000, 1000]]
    cost = costs(free, [64000, 64000, 64000, 9000], Shape(0, 0), 4000)
    # node 1 has no idle GPU; node 2 half a card; node 0 two idle cards; node 3 would also strand them
    assert list(np.argsort(cost)) == [1, 2, 0, 3]


def test_equal_placements_keep_to_one_node_order_whatever_the_names_are_listed_in() -> None:
    names = [f"node-{i}" for i in range(6)]
    first = costs([[1000] * 2] * 6, [64000] * 6, Shape(500), 1000, names)
    assert len(set(first.tolist())) == 6, "equal nodes still get distinct costs"
    again = costs([[1000] * 2] * 6, [64000] * 6, Shape(500), 1000, names[::-1])
    assert names[int(np.argmin(first))] == names[::-1][int(np.argmin(again))]


@pytest.mark.parametrize("fit", [policy(), Fgd(policy().workload)], ids=["fgdfit", "fgd"])
def test_a_cards_key_is_the_node_cost_of_taking_that_card(fit: Fgd) -> None:
    # prioritize takes the best card's key as the node's cost (keys_are_node_costs); bind uses node_cost
    assert fit.keys_are_node_costs
    capacity, free = np.full((2, 4), 1000), np.array([[1000, 300, 700, 0], [500, 500, 1000, 1000]])
    keys = fit.card_keys(capacity, free, np.full_like(free, 250), (Shape(250),))
    for card in range(4):
        after = free.copy()
        after[:, card] -= 250
        assert keys[:, card] == pytest.approx(fit.node_cost(capacity, free, after, (Shape(250),)))


def node(name: str, cpu: str, memory: str, cards: list[Card] | None = None) -> dict:
    annotations = {NODE_ANN_INVENTORY: format_inventory(cards, GIB)} if cards else {}
    return {
        "metadata": {"name": name, "resourceVersion": str(next(_versions)), "annotations": annotations},
        "status": {"allocatable": {"cpu": cpu, "memory": memory}},
    }


def plain_pod(name: str, node_name: str | None, cpu: str, memory: str, phase: str = "Running") -> dict:
    pod = gpu_pod(name, [container("main")], node=node_name, phase=phase)
    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cpu, "memory": memory}
    return pod


def test_a_pods_request_is_the_larger_of_its_containers_sum_and_its_largest_init_container() -> None:
    pod = plain_pod("p", None, "500m", "1Gi")
    pod["spec"]["containers"].append({"name": "side", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}})
    pod["spec"]["initContainers"] = [{"name": "init", "resources": {"requests": {"cpu": "2", "memory": "1Mi"}}}]
    assert host_request(pod) == (2000, 2 * GiB)


def test_the_cache_counts_what_running_pods_request_on_each_node() -> None:
    cache = ClusterCache(None)
    cache.nodes.apply(node("n1", "32", "64Gi", [Card(0, "GPU-n1-0", "T4", 16384, minor=0)]))
    cache.pods.apply(plain_pod("a", "n1", "4", "8Gi"))
    cache.pods.apply(plain_pod("done", "n1", "8", "8Gi", phase="Succeeded"))
    assert cache.view("n1").host_free == (28000, 56 * GiB)
    cache.pods.apply(plain_pod("b", "n1", "2500m", "1Gi"))
    assert cache.view("n1").host_free == (25500, 55 * GiB)


def gpu_cluster() -> ClusterCache:
    cache = ClusterCache(None)
    cards = [Card(i, f"GPU-{i}", "T4", 16384, minor=i) for i in range(2)]
    for name in ("idle", "busy"):
        cache.nodes.apply(
            node(name, "32", "64Gi", [Card(i, f"GPU-{name}-{i}", "T4", 16384, minor=i) for i in range(2)])
        )
    for i, card in enumerate(cards):
        cache.pods.apply(
            gpu_pod(
                f"g{i}",
                [container("main", 16)],
                node="busy",
                allocation={"main": (CardSlice(card.index, "GPU-busy-" + str(i), 16),)},
            )
        )
    cache.nodes.apply(node("cpu-only", "32", "64Gi"))
    return cache


NAMES = ["idle", "busy", "cpu-only"]


def body(pod: dict) -> dict:
    return {"Pod": pod, "NodeNames": NAMES}


def test_host_prioritize_steers_pods_without_gpus_and_leaves_gpu_pods_to_the_gpu_entry() -> None:
    engine = PlacementEngine(gpu_cluster(), "fgdfit")
    scores = host_scores(_json(host_prioritize_result(engine, body(plain_pod("p", None, "1", "1Gi")))), NAMES)
    assert scores["idle"] < scores["busy"] == scores["cpu-only"] == 10
    gpu = gpu_pod("g", [container("main", 4)], node=None)
    assert set(host_scores(_json(host_prioritize_result(engine, body(gpu))), NAMES).values()) == {0}
    assert max(host_scores(_json(prioritize_result(engine, body(gpu))), NAMES).values()) == 10


def test_host_prioritize_is_neutral_under_a_policy_that_ignores_cpu() -> None:
    engine = PlacementEngine(gpu_cluster(), "binpack")
    reply = _json(host_prioritize_result(engine, body(plain_pod("p", None, "1", "1Gi"))))
    assert set(host_scores(reply, NAMES).values()) == {0}


def _json(reply: Raw | list[dict]) -> list[dict]:
    return reply if isinstance(reply, list) else json.loads(reply.text)


def test_kube_default_scores_are_least_allocated_plus_balanced() -> None:
    state = ClusterState.of([TraceNode("a", 10000, 10000, 1, "T4"), TraceNode("b", 10000, 20000, 1, "T4")])
    pod = TracePod("p", 5000, 5000, 0, 0)
    # a: 50% CPU and memory used after -> least 50, balanced 100; b: 50% CPU, 25% memory -> 62, 75
    assert kube_default_scores(state, np.array([0, 1]), pod).tolist() == [150, 137]


def test_the_deployed_host_entry_only_prioritizes_with_the_replayed_weight() -> None:
    config = yaml.safe_load((DEPLOY / "scheduler-config.yaml").read_text())
    (entry,) = [e for e in config["extenders"] if e.get("prioritizeVerb") == "prioritize-host"]
    assert entry["weight"] == HOST_WEIGHT
    assert not entry.get("managedResources") and not entry.get("bindVerb") and not entry.get("filterVerb")
