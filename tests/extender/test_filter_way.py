"""Filter decides each pod one way, chosen from the pod's ask alone; each verb reads its pod once."""

from __future__ import annotations

import pytest
from gpushare.extender import verbs
from gpushare.extender.asks import read_ask
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.filterway import Way, filter_way
from podfactory import container, gpu_pod

from gpushare.cards import Card
from gpushare.contract import request as request_module
from gpushare.contract.allocation import CardSlice
from gpushare.contract.cardrule import card_rule_annotations
from gpushare.contract.errors import ContractError
from gpushare.contract.gang import format_gang
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import ANN_GPU_MODEL, NODE_ANN_INVENTORY
from gpushare.contract.units import GIB
from gpushare.placement import CardRule


def pending(*containers: dict, init: tuple[dict, ...] = (), annotations: dict | None = None) -> dict:
    return gpu_pod("p", containers, node=None, init=init, extra_annotations=annotations)


def in_gang(pod: dict) -> dict:
    pod["metadata"]["labels"] = format_gang("train", 2)
    return pod


NVLINK = card_rule_annotations(CardRule(nvlink=True))


@pytest.mark.parametrize(
    ("pod", "way"),
    [
        (gpu_pod("cpu", [container("main")], node=None), Way.EVERY_NODE),
        (pending(container("main", 4)), Way.MATRIX),
        (pending(container("main", 4), init=(container("setup", 2),)), Way.EACH_NODE),
        (pending(container("setup")), Way.EVERY_NODE),
        (pending(container("main", count=1)), Way.MATRIX_KNOWN_CARDS),
        (pending(container("main", 8, 2)), Way.MATRIX_KNOWN_CARDS),
        (pending(container("main", 8, 2), annotations=NVLINK), Way.EACH_NODE),
        (pending(container("main", 4), annotations=NVLINK), Way.MATRIX),
        (pending(container("a", 4), container("b", 4)), Way.EACH_NODE),
        (in_gang(pending(container("main", 4))), Way.GANG),
    ],
    ids=["no-gpu", "shared", "init", "init-without-gpu", "whole-card", "two-cards", "nvlink", "nvlink-one-card",
         "two-containers", "gang"],
)  # fmt: skip
def test_each_pod_takes_one_way(pod: dict, way: Way) -> None:
    assert filter_way(read_ask(pod), places_gangs=True) is way


def test_a_pod_without_gpus_passes_whatever_its_card_rule_says() -> None:
    ask = read_ask(gpu_pod("cpu", [container("main")], node=None, extra_annotations={ANN_GPU_MODEL: ""}))
    assert filter_way(ask, places_gangs=True) is Way.EVERY_NODE
    with pytest.raises(ContractError, match="default/cpu"):
        ask.rule  # noqa: B018


@pytest.mark.parametrize(
    ("pod", "places_gangs", "reason"),
    [
        (pending(container("main", 9, 2)), True, "not divisible"),
        (pending(container("main", 4), annotations={ANN_GPU_MODEL: ""}), True, ANN_GPU_MODEL),
        (in_gang(pending(container("main", 4))), False, "places no gangs"),
    ],
)
def test_a_pod_that_cant_be_read_is_refused_with_the_reason(pod: dict, places_gangs: bool, reason: str) -> None:
    ask = read_ask(pod)  # reading never raises; the part at fault does, when it is read
    with pytest.raises(ContractError, match=reason) as raised:
        filter_way(ask, places_gangs)
    assert "default/p" in str(raised.value)


@pytest.fixture
def engine() -> PlacementEngine:
    cache = ClusterCache(None)
    cards = [Card(i, f"GPU-{i}", "X", 16384, minor=i) for i in range(2)]
    annotations = {NODE_ANN_INVENTORY: format_inventory(cards, GIB)}
    cache.nodes.apply({"metadata": {"name": "n1", "resourceVersion": "1", "annotations": annotations}})
    for i in range(3):
        held = {"main": (CardSlice(0, "GPU-0", 2),)}
        bound = gpu_pod(f"b{i}", [container("main", 2)], node="n1", allocation=held, uid=f"uid-b{i}")
        bound["metadata"]["resourceVersion"] = str(10 + i)
        cache.pods.apply(bound)
    return PlacementEngine(cache, "binpack")


@pytest.mark.parametrize(
    "pod",
    [pending(container("main", 4)), pending(container("a", 4), container("b", 4), init=(container("i", 2),))],
    ids=["matrix", "each-node"],
)
def test_each_verb_reads_its_pod_once(engine: PlacementEngine, pod: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    engine.cache.assume("uid-other", "n1", {"GPU-1": 1})  # the node changed: its view is built again
    read: list[str] = []
    real = request_module._container_request
    monkeypatch.setattr(
        request_module, "_container_request", lambda key, spec, init: read.append(key) or real(key, spec, init)
    )
    body = {"Pod": pod, "NodeNames": ["n1"]}
    containers = len(pod["spec"]["containers"]) + len(pod["spec"].get("initContainers", []))
    assert verbs.filter_result(engine, body)["FailedNodes"] == {}
    assert read == ["default/p"] * containers, "filter read the pod, or the node's pods, more than once"
    read.clear()
    assert verbs.prioritize_result(engine, body)
    assert read == ["default/p"] * containers
