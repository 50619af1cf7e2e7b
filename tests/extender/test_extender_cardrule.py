"""The extender's filter, prioritize and bind over HTTP for pods that choose their card model or
require NVLink / one NUMA node / memory limits (n1: two NVLinked A100-80GB on NUMA 0 and a T4 on NUMA 1;
n2: an A10; no simulated card enforces memory limits)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gpushare.advertiser.agent import Advertiser
from podfactory import container, gpu_pod
from support.extender import Cluster, host_scores
from support.waiting import wait_until

from gpushare.cards import ENFORCED
from gpushare.contract.names import (
    ANN_GPU_MODEL,
    ANN_GPU_MODEL_AVOID,
    ANN_REQUIRE_MEMORY_LIMIT,
    ANN_REQUIRE_NVLINK,
    ANN_REQUIRE_SAME_NUMA,
)
from gpushare.contract.units import GIB
from gpushare.gpus.backend import CardBook
from gpushare.gpus.simulated import SIMULATED_LIMITS


def ruled(name: str, containers: list[dict], **annotations: str) -> dict:
    return gpu_pod(name, containers, extra_annotations=annotations)


def test_a_pod_that_asks_for_a100_only_is_filtered_and_bound_onto_an_a100(cluster: Cluster) -> None:
    pod = cluster.pod(ruled("a100", [container("main", 10)], **{ANN_GPU_MODEL: "A100-80GB|A100-40GB"}))
    result = cluster.filter(pod)
    assert result["NodeNames"] == ["n1"]
    assert result["FailedNodes"] == {"n2": "no A100-40GB or A100-80GB card on the node (A10 cards ignored)"}
    assert cluster.bind(pod, "n1")["Error"] == ""
    a0, a1, _ = cluster.backends["n1"].cards()
    assert cluster.allocation("a100")["main"][0].uuid in (a0.uuid, a1.uuid)
    # without the annotation, binpack takes the T4, the fullest card that fits
    plain = cluster.pod(gpu_pod("plain", [container("main", 10)]))
    assert cluster.bind(plain, "n1")["Error"] == ""
    assert cluster.allocation("plain")["main"][0].index == 2


def test_the_reason_names_the_model_and_the_cards_ignored(cluster: Cluster) -> None:
    pod = cluster.pod(ruled("huge", [container("main", 90)], **{ANN_GPU_MODEL: "A100-80GB"}))
    reasons = cluster.filter(pod, ["n1"])["FailedNodes"]
    assert reasons == {"n1": "no A100-80GB card has 90 GiB free (largest free: 80 GiB on card 0; T4 cards ignored)"}
    assert "no A100-80GB card has 90 GiB free" in cluster.bind(pod, "n1")["Error"]


def test_prioritize_and_bind_skip_avoided_models(cluster: Cluster) -> None:
    pod = cluster.pod(ruled("no-a10", [container("main", 14)], **{ANN_GPU_MODEL_AVOID: "A10|T4"}))
    assert cluster.filter(pod)["NodeNames"] == ["n1"]
    scores = cluster.post("prioritize", {"Pod": pod, "NodeNames": ["n1", "n2"]})
    assert host_scores(scores, ["n1", "n2"]) == {"n1": 10, "n2": 0}
    assert cluster.bind(pod, "n2")["Error"].endswith("no non-A10 non-T4 card on the node (A10 cards ignored)")
    assert cluster.bind(pod, "n1")["Error"] == ""
    assert cluster.allocation("no-a10")["main"][0].index in (0, 1)


@pytest.mark.parametrize(
    ("requirement", "words"),
    [(ANN_REQUIRE_NVLINK, "pairwise NVLink-connected"), (ANN_REQUIRE_SAME_NUMA, "on one NUMA node")],
)
def test_a_topology_requirement_filters_out_nodes_that_cant_meet_it(
    cluster: Cluster, requirement: str, words: str
) -> None:
    whole = cluster.pod(ruled("whole", [container("main", 0, 1)], **{ANN_GPU_MODEL: "A100"}))
    assert cluster.bind(whole, "n1")["Error"] == ""
    wait_until(lambda: sum(c.used > 0 for c in cluster.extender.cache.view("n1").cards) == 1, what="the bind")
    # one free A100 and the T4 are left: two cards, but neither NVLink peers nor on one NUMA node
    plain = cluster.pod(gpu_pod("plain", [container("main", 20, 2)]))
    assert cluster.filter(plain)["NodeNames"] == ["n1"]
    pair = cluster.pod(ruled("pair", [container("main", 20, 2)], **{requirement: "true"}))
    result = cluster.filter(pair)
    assert result["NodeNames"] == []
    assert result["FailedNodes"]["n1"].startswith(
        f"no cards {words} (required) can take 2 cards with 10 GiB free each (free GiB:"
    )
    assert result["FailedNodes"]["n2"].startswith("needs 2 cards with 10 GiB free each, 1 have")
    scores = cluster.post("prioritize", {"Pod": pair, "NodeNames": ["n1"]})
    assert host_scores(scores, ["n1"]) == {"n1": 0}
    assert f"no cards {words} (required)" in cluster.bind(pair, "n1")["Error"]
    # once the first pod is gone, the NVLinked A100 pair on NUMA 0 takes it
    cluster.core.delete_namespaced_pod("whole", "default", grace_period_seconds=0)
    wait_until(lambda: cluster.filter(pair)["NodeNames"] == ["n1"], what="the freed card in the cache")
    assert cluster.bind(pair, "n1")["Error"] == ""
    assert sorted(s.index for s in cluster.allocation("pair")["main"]) == [0, 1]


def test_a_bad_card_annotation_fails_every_node_naming_pod_and_annotation(cluster: Cluster) -> None:
    pod = cluster.pod(ruled("bad", [container("main", 1)], **{ANN_REQUIRE_NVLINK: "always"}))
    result = cluster.filter(pod)
    assert result["NodeNames"] == []
    assert result["FailedAndUnresolvableNodes"] == dict.fromkeys(
        ["n1", "n2"], f"pod default/bad annotation {ANN_REQUIRE_NVLINK}: 'always' is neither 'true' nor 'false'"
    )
    assert f"annotation {ANN_REQUIRE_NVLINK}" in cluster.bind(pod, "n1")["Error"]


def test_a_pod_requiring_memory_limits_is_refused_nodes_whose_cards_dont_enforce_them(cluster: Cluster) -> None:
    pod = cluster.pod(ruled("capped", [container("main", 10)], **{ANN_REQUIRE_MEMORY_LIMIT: "true"}))
    a0, a1, t4 = cluster.backends["n1"].cards()
    (a10,) = cluster.backends["n2"].cards()
    result = cluster.filter(pod)
    assert result["NodeNames"] == []
    assert result["FailedNodes"] == {
        "n1": f"no limit-enforcing card on the node (cards 0 ({a0.uuid}), 1 ({a1.uuid}), 2 ({t4.uuid}) "
        f"don't enforce GPU memory limits: {SIMULATED_LIMITS})",
        "n2": f"no limit-enforcing card on the node (card 0 ({a10.uuid}) doesn't enforce GPU memory limits: "
        f"{SIMULATED_LIMITS})",
    }
    assert f"card 0 ({a10.uuid}) doesn't enforce GPU memory limits" in cluster.bind(pod, "n2")["Error"]
    # once n1's agent reports the second A100 enforcing limits, the pod goes there and nowhere else
    Advertiser(cluster.api, "n1", CardBook([a0, replace(a1, memory_limits=ENFORCED), t4]), GIB).publish_once()
    wait_until(lambda: cluster.filter(pod)["NodeNames"] == ["n1"], what="the enforcing card in the cache")
    assert cluster.bind(pod, "n1")["Error"] == ""
    assert cluster.allocation("capped")["main"][0].uuid == a1.uuid


def test_a_bad_memory_limit_annotation_fails_every_node_naming_pod_and_annotation(cluster: Cluster) -> None:
    pod = cluster.pod(ruled("unsure", [container("main", 1)], **{ANN_REQUIRE_MEMORY_LIMIT: "yes"}))
    assert cluster.filter(pod)["FailedAndUnresolvableNodes"] == dict.fromkeys(
        ["n1", "n2"],
        f"pod default/unsure annotation {ANN_REQUIRE_MEMORY_LIMIT}: 'yes' is neither 'true' nor 'false'",
    )
