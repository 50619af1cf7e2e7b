"""Each node is parsed into its view once per change on it: filter and prioritize over many nodes read the
views, and a node nothing happened to is not parsed again."""

from __future__ import annotations

import pytest
from gpushare.extender import cache as cache_module
from gpushare.extender import verbs
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.nodeview import NodeView
from podfactory import container, gpu_pod

from gpushare.cards import Card
from gpushare.contract.allocation import CardSlice
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY
from gpushare.contract.units import GIB

CARDS = [Card(i, f"GPU-{i}", "X", 16384, minor=i) for i in range(2)]
NODES = ("n1", "n2", "n3")


def gpu_node(name: str) -> dict:
    annotations = {NODE_ANN_INVENTORY: format_inventory(CARDS, GIB)}
    return {
        "metadata": {"name": name, "resourceVersion": "1", "annotations": annotations, "labels": {"zone": "a"}},
        "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "pods": "10"}},
    }


@pytest.fixture
def engine() -> PlacementEngine:
    cache = ClusterCache(None)
    for name in NODES:
        cache.nodes.apply(gpu_node(name))
    return PlacementEngine(cache, "binpack")


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The nodes whose views were built, in order."""
    built: list[str] = []
    real = cache_module.build_view

    def counted(name: str, *args: object, **kwargs: object) -> NodeView:
        built.append(name)
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cache_module, "build_view", counted)
    return built


def schedule(engine: PlacementEngine) -> None:
    body = {"Pod": gpu_pod("p", [container("main", 4)], node=None), "NodeNames": list(NODES)}
    assert verbs.filter_result(engine, body)["FailedNodes"] == {}
    verbs.prioritize_result(engine, body)


def test_filter_and_prioritize_build_each_view_once_until_its_node_changes(
    engine: PlacementEngine, builds: list[str]
) -> None:
    schedule(engine)
    assert sorted(builds) == sorted(NODES)
    before = {name: engine.cache.view(name) for name in NODES}
    builds.clear()
    schedule(engine)
    assert builds == [], "a node nothing happened to was parsed again"
    assert all(engine.cache.view(name) is before[name] for name in NODES)
    held = {"main": (CardSlice(0, "GPU-0", 4),)}
    engine.cache.pods.apply(gpu_pod("b", [container("main", 4)], node="n2", allocation=held, uid="uid-b"))
    schedule(engine)
    assert builds == ["n2"]
    assert engine.cache.view("n1") is before["n1"]


def test_the_view_carries_what_the_verbs_read_of_the_node(engine: PlacementEngine) -> None:
    cache = engine.cache
    pod = gpu_pod("b", [container("main", 4)], node="n1", allocation={"main": (CardSlice(0, "GPU-0", 4),)})
    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "2", "memory": "4Gi"}
    cache.pods.apply(pod)
    cache.assume("uid-flying", "n1", {"GPU-1": 2})
    view = cache.view("n1")
    assert view is not None
    assert [card.used for card in view.cards] == [4, 2]
    assert view.host_free == (6000, 28 << 30)
    assert view.pod_room == 9
    assert view.assumed == (("uid-flying", {"GPU-1": 2}),)
    assert list(view.requests) == ["default/b"] and len(view.pods) == 1
    assert view.facts.labels == {"zone": "a"}
    cache.forget("uid-flying")
    assert [card.used for card in cache.view("n1").cards] == [4, 0]
