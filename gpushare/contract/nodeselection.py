"""Which nodes Kubernetes lets a pod go to: its ``nodeSelector``, its required node affinity and its
tolerations against a node's labels, name and taints (``NoSchedule`` and ``NoExecute``; a cordoned node
counts as tainted ``node.kubernetes.io/unschedulable:NoSchedule``), as kube-scheduler's NodeAffinity,
TaintToleration and NodeUnschedulable filters decide.

Pod and node are parsed once (:func:`parse_pod_nodes`, :func:`parse_node_facts`) into plain values;
:func:`node_refusal` decides over them without I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.names import FIELD_NODE_NAME, TAINT_UNSCHEDULABLE
from gpushare.contract.request import pod_key

#: taint effects that keep a pod off a node (``PreferNoSchedule`` only lowers its score)
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
_SET_OPERATORS = frozenset({"In", "NotIn"})
_LABEL_OPERATORS = _SET_OPERATORS | {"Exists", "DoesNotExist", "Gt", "Lt"}
_AFFINITY = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"


@dataclass(frozen=True, slots=True)
class Requirement:
    """One ``matchExpressions`` (on a label) or ``matchFields`` (on the node's name) entry."""

    key: str
    operator: str
    values: frozenset[str] = frozenset()
    #: the integer of ``Gt`` and ``Lt``
    bound: int = 0

    def matches(self, value: str | None) -> bool:
        """Whether a node whose label (or field) ``key`` is ``value`` (None: absent) satisfies it."""
        if self.operator == "In":
            return value in self.values
        if self.operator == "NotIn":
            return value not in self.values
        if self.operator == "Exists":
            return value is not None
        if self.operator == "DoesNotExist":
            return value is None
        try:
            number = int(value or "")
        except ValueError:
            return False
        return number > self.bound if self.operator == "Gt" else number < self.bound


@dataclass(frozen=True, slots=True)
class Term:
    """A node selector term: every requirement must hold (an empty term matches no node)."""

    labels: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str

    def __str__(self) -> str:
        return f"{quoted(self.key)}={quoted(self.value)}:{self.effect}"


@dataclass(frozen=True, slots=True)
class Toleration:
    """``key`` "" with ``Exists`` tolerates every taint; ``effect`` "" every effect."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == taint.value


@dataclass(frozen=True, slots=True)
class PodNodes:
    """What of a pod decides which nodes it may go to. ``terms`` None: no required node affinity."""

    selector: tuple[tuple[str, str], ...] = ()
    terms: tuple[Term, ...] | None = None
    tolerations: tuple[Toleration, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What of a node decides which pods may go to it."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()


ANY_NODE = PodNodes()


def node_refusal(pod: PodNodes, node: NodeFacts) -> str | None:
    """Why the pod may not go to the node, or None when it may."""
    for key, value in pod.selector:
        if node.labels.get(key) != value:
            return f"node {node.name} doesn't match the pod's nodeSelector ({quoted(key)}={quoted(value)})"
    if pod.terms is not None and not any(_term_matches(term, node) for term in pod.terms):
        return f"node {node.name} doesn't satisfy the pod's required node affinity"
    for taint in node.taints:
        if taint.effect in BLOCKING_EFFECTS and not any(t.tolerates(taint) for t in pod.tolerations):
            return f"node {node.name} has taint {taint}, which the pod doesn't tolerate"
    return None


def _term_matches(term: Term, node: NodeFacts) -> bool:
    if not term.labels and not term.fields:
        return False
    return all(r.matches(node.labels.get(r.key)) for r in term.labels) and all(
        r.matches(node.name) for r in term.fields
    )


def parse_pod_nodes(pod: Mapping[str, Any]) -> PodNodes:
    """The pod's nodeSelector, required node affinity and tolerations; ContractError naming the pod and
    field when one can't be read."""
    where = f"pod {pod_key(pod)}"
    spec = pod.get("spec") or {}
    selector = _mapping(spec.get("nodeSelector"), f"{where} spec.nodeSelector")
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ))  # fmt: skip
    terms = None
    if required:
        raw_terms = _sequence(required.get("nodeSelectorTerms"), f"{where} {_AFFINITY}.nodeSelectorTerms")
        terms = tuple(_term(term, f"{where} {_AFFINITY}.nodeSelectorTerms[{i}]") for i, term in enumerate(raw_terms))
    tolerations = tuple(
        _toleration(t, f"{where} spec.tolerations[{i}]")
        for i, t in enumerate(_sequence(spec.get("tolerations"), f"{where} spec.tolerations"))
    )
    return PodNodes(tuple(sorted(selector.items())), terms, tolerations)


def parse_node_facts(node: Mapping[str, Any]) -> NodeFacts:
    """The node's name, labels and taints (a cordoned node with the unschedulable taint); taints that
    can't be read are kept as written, so that no pod tolerates them by accident."""
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    taints = [
        Taint(str(t.get("key") or ""), str(t.get("value") or ""), str(t.get("effect") or ""))
        for t in spec.get("taints") or ()
        if isinstance(t, Mapping)
    ]
    if spec.get("unschedulable"):
        taints.append(Taint(TAINT_UNSCHEDULABLE, "", "NoSchedule"))
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    return NodeFacts(str(meta.get("name") or ""), labels, tuple(taints))


def _mapping(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ContractError(f"{where}: expected a map of strings")
    return {str(k): str(v) for k, v in value.items()}


def _sequence(value: Any, where: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ContractError(f"{where}: expected a list")
    return value


def _term(raw: Any, where: str) -> Term:
    if not isinstance(raw, Mapping):
        raise ContractError(f"{where}: expected a node selector term")
    labels = tuple(
        _requirement(r, f"{where}.matchExpressions[{i}]", _LABEL_OPERATORS)
        for i, r in enumerate(_sequence(raw.get("matchExpressions"), f"{where}.matchExpressions"))
    )
    fields = tuple(
        _requirement(r, f"{where}.matchFields[{i}]", _SET_OPERATORS)
        for i, r in enumerate(_sequence(raw.get("matchFields"), f"{where}.matchFields"))
    )
    for i, requirement in enumerate(fields):
        if requirement.key != FIELD_NODE_NAME:
            raise ContractError(
                f"{where}.matchFields[{i}]: key {quoted(requirement.key)} is not {FIELD_NODE_NAME}, the only "
                "field a node selector may name"
            )
    return Term(labels, fields)


def _requirement(raw: Any, where: str, operators: frozenset[str]) -> Requirement:
    if not isinstance(raw, Mapping):
        raise ContractError(f"{where}: expected {{key, operator, values}}")
    key, operator = str(raw.get("key") or ""), raw.get("operator")
    values = [str(v) for v in _sequence(raw.get("values"), f"{where}.values")]
    if operator not in operators:
        raise ContractError(f"{where}: operator {quoted(operator)} is not one of {', '.join(sorted(operators))}")
    if operator in _SET_OPERATORS and not values:
        raise ContractError(f"{where}: operator {operator} needs values")
    if operator in ("Exists", "DoesNotExist") and values:
        raise ContractError(f"{where}: operator {operator} takes no values")
    bound = 0
    if operator in ("Gt", "Lt"):
        try:
            (bound,) = (int(v) for v in values)
        except ValueError:
            raise ContractError(f"{where}: operator {operator} needs one integer value, got {quoted(values)}") from None
    return Requirement(key, operator, frozenset(values), bound)


def _toleration(raw: Any, where: str) -> Toleration:
    if not isinstance(raw, Mapping):
        raise ContractError(f"{where}: expected {{key, operator, value, effect}}")
    operator = raw.get("operator") or "Equal"
    if operator not in ("Equal", "Exists"):
        raise ContractError(f"{where}: operator {quoted(operator)} is neither Equal nor Exists")
    key = str(raw.get("key") or "")
    if not key and operator != "Exists":
        raise ContractError(f"{where}: a toleration without a key needs operator Exists")
    return Toleration(key, operator, str(raw.get("value") or ""), str(raw.get("effect") or ""))
