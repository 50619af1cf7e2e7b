"""A bind for a pod that is bound already (kube-scheduler sends one again when its first call timed out
and its informer had not seen the binding yet), and a binding the API server refuses: neither may change
what the node's ledger or the pod's annotations say it holds."""

from __future__ import annotations

from typing import Any

import pytest
from gpushare.extender import bind as bind_module
from podfactory import container, gpu_pod
from support.extender import Cluster
from support.waiting import wait_until

from gpushare.contract.names import NODE_ANN_PENDING_BINDS
from gpushare.contract.pending import parse_pending_binds
from gpushare.kube.errors import KubeConflict


def ledger(cluster: Cluster, node: str) -> dict[str, Any]:
    """The node's ledger annotation, parsed (an empty one when the node has none)."""
    annotations = cluster.core.read_node(node).metadata.annotations or {}
    return parse_pending_binds(annotations.get(NODE_ANN_PENDING_BINDS), node)


def pod_annotations(cluster: Cluster, name: str) -> dict[str, str]:
    return cluster.core.read_namespaced_pod(name, "default").metadata.annotations or {}


def bound_pod(cluster: Cluster, name: str, gib: int) -> dict[str, Any]:
    """A pod bound to n1 by the extender, once the extender's cache shows it bound."""
    pod = cluster.pod(gpu_pod(name, [container("main", gib)]))
    assert cluster.bind(pod, "n1")["Error"] == ""
    wait_until(
        lambda: (cluster.extender.cache.pod("default", name) or ({}, None))[0].get("spec", {}).get("nodeName"),
        what=f"pod {name} bound in the extender's cache",
    )
    return pod


def test_a_second_bind_to_the_same_node_answers_success_and_writes_nothing(cluster: Cluster) -> None:
    pod = bound_pod(cluster, "p", 40)
    before, annotations = ledger(cluster, "n1"), pod_annotations(cluster, "p")
    assert cluster.bind(pod, "n1")["Error"] == ""
    assert ledger(cluster, "n1") == before
    assert pod_annotations(cluster, "p") == annotations


def test_a_second_bind_to_another_node_is_refused_and_writes_nothing(cluster: Cluster) -> None:
    pod = bound_pod(cluster, "p", 20)
    before, annotations = ledger(cluster, "n1"), pod_annotations(cluster, "p")
    reply = cluster.bind(pod, "n2")
    assert "bound to node n1 already" in reply["Error"], reply
    assert ledger(cluster, "n2") == {}
    assert ledger(cluster, "n1") == before
    assert pod_annotations(cluster, "p") == annotations


def test_a_second_bind_the_cache_does_not_show_bound_yet_writes_nothing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache still has the pod unbound: its entry in the node's ledger makes the bind read the pod."""
    unbound = cluster.pod(gpu_pod("p", [container("main", 40)]))
    assert cluster.bind(unbound, "n1")["Error"] == ""
    before, annotations = ledger(cluster, "n1"), pod_annotations(cluster, "p")
    cache = cluster.extender.cache
    pods_on = cache.pods_on
    monkeypatch.setattr(cache, "pod", lambda namespace, name: (unbound, bind_module.read_ask(unbound)))
    monkeypatch.setattr(cache, "pods_on", lambda node: [p for p in pods_on(node) if p["metadata"]["name"] != "p"])
    assert cluster.bind(unbound, "n1")["Error"] == ""
    assert ledger(cluster, "n1") == before
    assert pod_annotations(cluster, "p") == annotations


def test_a_refused_binding_puts_the_ledger_back(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    def conflict(*_args: Any, **_kwargs: Any) -> None:
        raise KubeConflict('binding of pod default/p to node n1: 409 Conflict: pod p is already assigned to node "n2"')

    monkeypatch.setattr(bind_module, "bind_pod", conflict)
    pod = cluster.pod(gpu_pod("p", [container("main", 40)]))
    before = ledger(cluster, "n1")
    reply = cluster.bind(pod, "n1")
    assert "409" in reply["Error"] and "taken back" in reply["Error"], reply
    assert ledger(cluster, "n1") == before
    assert cluster.extender.cache.assumed_on("n1") == []
