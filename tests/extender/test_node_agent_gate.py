"""No GPU pod is placed on a node while its node agent pod is not Ready (killed, restarting, replaced by a
rolling update): kubelet would refuse the pod for good, its device plugin being away."""

from __future__ import annotations

from typing import Any

import pytest
from gpushare.extender import verbs
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from podfactory import container, gpu_pod

from gpushare.cards import Card
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import NODE_AGENT_LABEL, NODE_ANN_INVENTORY
from gpushare.contract.units import GIB

NAMESPACE = "gpushare-system"
CARDS = [Card(i, f"GPU-{i}", "X", 16384, minor=i) for i in range(2)]


def agent(name: str, node: str, ready: bool, namespace: str = NAMESPACE, version: int = 1, **meta: Any) -> dict:
    key, value = NODE_AGENT_LABEL
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": {key: value},
                     "resourceVersion": str(version), **meta},
        "spec": {"nodeName": node, "containers": [{"name": "node-agent"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


@pytest.fixture
def engine() -> PlacementEngine:
    cache = ClusterCache(None, node_agent_namespace=NAMESPACE)
    for node in ("n1", "n2"):
        annotations = {NODE_ANN_INVENTORY: format_inventory(CARDS, GIB)}
        cache.nodes.apply({"metadata": {"name": node, "resourceVersion": "1", "annotations": annotations}})
    return PlacementEngine(cache, "binpack")


def failed(engine: PlacementEngine) -> dict[str, str]:
    body = {"Pod": gpu_pod("p", [container("main", 4)], node=None), "NodeNames": ["n1", "n2"]}
    result = verbs.filter_result(engine, body)
    return {**result.get("FailedNodes", {}), **result.get("FailedAndUnresolvableNodes", {})}


def test_a_node_whose_agent_pod_is_not_ready_takes_no_gpu_pod_until_it_is(engine: PlacementEngine) -> None:
    pods = engine.cache.pods
    pods.apply(agent("agent-a", "n1", ready=True))
    pods.apply(agent("agent-b", "n2", ready=True))
    assert failed(engine) == {}
    pods.apply(agent("agent-a", "n1", ready=False, version=2))  # kill -9: kubelet saw the container end
    refused = failed(engine)
    assert set(refused) == {"n1"} and "node n1: its gpushare node agent" in refused["n1"]
    assert engine.cache.agent_problem("n1") and engine.cache.agent_problem("n2") is None
    pods.apply(agent("agent-a", "n1", ready=True, version=3))  # restarted, its readiness probe passed
    assert failed(engine) == {}


def test_while_a_rolling_update_replaces_the_agent_the_node_takes_no_gpu_pod(engine: PlacementEngine) -> None:
    pods = engine.cache.pods
    pods.apply(agent("old", "n1", ready=True))
    pods.apply(agent("old", "n1", ready=True, version=2, deletionTimestamp="2026-11-28T15:00:00Z"))
    assert "n1" in failed(engine)  # terminating, though still Ready
    pods._store("DELETED", agent("old", "n1", ready=True, version=3))  # as the watch brings it
    assert "n1" in failed(engine)  # gone, before the DaemonSet made the new one
    pods.apply(agent("new", "n1", ready=False, version=4))
    assert "n1" in failed(engine)
    pods.apply(agent("new", "n1", ready=True, version=5))
    assert failed(engine) == {}


def test_only_the_agents_own_namespace_counts_and_nodes_without_an_agent_pod_are_not_checked(
    engine: PlacementEngine,
) -> None:
    pods = engine.cache.pods
    # a tenant's look-alike can neither take a node down nor hold one up
    pods.apply(agent("fake", "n2", ready=False, namespace="tenant"))
    assert failed(engine) == {}
    pods.apply(agent("agent-b", "n2", ready=False))
    pods.apply(agent("fake-up", "n2", ready=True, namespace="tenant"))
    assert set(failed(engine)) == {"n2"}
    # an extender told no namespace checks nothing
    plain = ClusterCache(None)
    plain.pods.apply(agent("agent-b", "n2", ready=False))
    assert plain.agent_problem("n2") is None
