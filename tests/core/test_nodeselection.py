"""Which nodes a pod may go to (nodeSelector, required node affinity, taints and tolerations), without I/O."""

from __future__ import annotations

from typing import Any

import pytest

from gpushare.contract.errors import ContractError
from gpushare.contract.nodeselection import NodeFacts, Taint, node_refusal, parse_node_facts, parse_pod_nodes

A100 = NodeFacts("a", {"gpu": "a100", "zone": "z1", "cards": "8"})
T4 = NodeFacts("b", {"gpu": "t4", "cards": "2"})


def pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "w", "namespace": "ml"}, "spec": spec}


def affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, **({"values": list(values)} if values else {})}


def allowed(spec: dict[str, Any], nodes: tuple[NodeFacts, ...] = (A100, T4)) -> list[str]:
    parsed = parse_pod_nodes(spec)
    return [n.name for n in nodes if node_refusal(parsed, n) is None]


def test_a_pod_without_constraints_may_go_anywhere_untainted() -> None:
    assert allowed(pod()) == ["a", "b"]


def test_node_selector_needs_every_label() -> None:
    assert allowed(pod(nodeSelector={"gpu": "a100", "zone": "z1"})) == ["a"]
    refusal = node_refusal(parse_pod_nodes(pod(nodeSelector={"gpu": "h100"})), A100)
    assert refusal == "node a doesn't match the pod's nodeSelector ('gpu'='h100')"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        (expr("gpu", "In", "a100", "h100"), ["a"]),
        (expr("gpu", "NotIn", "a100"), ["b"]),
        (expr("zone", "Exists"), ["a"]),
        (expr("zone", "DoesNotExist"), ["b"]),
        (expr("cards", "Gt", "4"), ["a"]),
        (expr("cards", "Lt", "4"), ["b"]),
        (expr("gpu", "Gt", "4"), []),  # a label that is no integer satisfies neither Gt nor Lt
    ],
)
def test_each_affinity_operator(expression: dict[str, Any], expected: list[str]) -> None:
    assert allowed(pod(affinity=affinity({"matchExpressions": [expression]}))) == expected


def test_terms_are_ored_and_requirements_anded_and_fields_name_the_node() -> None:
    both = {"matchExpressions": [expr("gpu", "In", "a100"), expr("zone", "In", "z2")]}
    assert allowed(pod(affinity=affinity(both))) == []
    assert allowed(pod(affinity=affinity(both, {"matchExpressions": [expr("gpu", "In", "t4")]}))) == ["b"]
    by_name = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["a"]}]}
    assert allowed(pod(affinity=affinity(by_name))) == ["b"]
    assert allowed(pod(affinity=affinity({}))) == [], "an empty term matches no node"
    refusal = node_refusal(parse_pod_nodes(pod(affinity=affinity(both))), A100)
    assert refusal == "node a doesn't satisfy the pod's required node affinity"


def test_taints_keep_off_pods_that_do_not_tolerate_them() -> None:
    tainted = parse_node_facts(
        {
            "metadata": {"name": "c", "labels": {}},
            "spec": {
                "taints": [
                    {"key": "gpu", "value": "reserved", "effect": "NoSchedule"},
                    {"key": "soft", "effect": "PreferNoSchedule"},
                ]
            },
        }
    )
    assert tainted.taints[0] == Taint("gpu", "reserved", "NoSchedule")
    assert node_refusal(parse_pod_nodes(pod()), tainted) == (
        "node c has taint 'gpu'='reserved':NoSchedule, which the pod doesn't tolerate"
    )
    for toleration in (
        {"key": "gpu", "value": "reserved"},
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"operator": "Exists"},
    ):
        assert allowed(pod(tolerations=[toleration]), (tainted,)) == ["c"], toleration
    for toleration in ({"key": "gpu", "value": "other"}, {"key": "gpu", "operator": "Exists", "effect": "NoExecute"}):
        assert allowed(pod(tolerations=[toleration]), (tainted,)) == [], toleration
    evicting = NodeFacts("d", {}, (Taint("x", "", "NoExecute"),))
    assert allowed(pod(), (evicting,)) == []


def test_a_cordoned_node_takes_only_pods_tolerating_unschedulable() -> None:
    cordoned = parse_node_facts({"metadata": {"name": "e"}, "spec": {"unschedulable": True}})
    assert allowed(pod(), (cordoned,)) == []
    tolerating = [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]
    assert allowed(pod(tolerations=tolerating), (cordoned,)) == ["e"]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (pod(affinity=affinity({"matchExpressions": [expr("gpu", "Near", "x")]})), "matchExpressions[0]"),
        (pod(affinity=affinity({"matchExpressions": [expr("cards", "Gt", "many")]})), "one integer"),
        (pod(affinity=affinity({"matchExpressions": [expr("gpu", "In")]})), "needs values"),
        (pod(affinity=affinity({"matchFields": [{"key": "spec.x", "operator": "In", "values": ["a"]}]})), "spec.x"),
        (pod(tolerations=[{"value": "x"}]), "spec.tolerations[0]"),
        (pod(nodeSelector=["gpu"]), "spec.nodeSelector"),
    ],
)
def test_unreadable_constraints_name_the_pod_and_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError, match="pod ml/w") as info:
        parse_pod_nodes(spec)
    assert field in str(info.value)
