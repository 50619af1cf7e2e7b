"""The admission policies of deploy/ read gpushare/contract/names.py's lists, which the webhook reads too:
the keys a tenant sets and those only gpushare writes (the policy that denies), the keys gpushare reads
(the policy that warns), and each node agent held to its own node (deploy/rbac.yaml). CEL can't run
here; tests/e2e/test_admission_policy.py and test_rbac.py run the policies on the real API server."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import yaml

from gpushare.contract.names import (
    GPUSHARE_ANNOTATIONS,
    KNOWN_POD_LABELS,
    PROTECTED_ANNOTATION_PREFIXES,
    PROTECTED_ANNOTATIONS,
    RESOURCES,
    TENANT_ANNOTATIONS,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NODE_AGENT = "system:serviceaccount:gpushare-system:gpushare-node-agent"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def objects(name: str) -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def policy(file: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy's spec and its binding's."""
    found = objects(file)
    return found["ValidatingAdmissionPolicy", name]["spec"], found["ValidatingAdmissionPolicyBinding", name]["spec"]


def variables(spec: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: " ".join(v["expression"].split()) for v in spec["variables"]}


def cel_strings(expression: str) -> set[str]:
    """A CEL list of string literals (single-quoted, as Python writes them) as a set."""
    return set(ast.literal_eval(expression))


def protected_key(var: str) -> str:
    """:func:`gpushare.contract.names.protected_annotation` in CEL, as the policy spells it."""
    prefixes = " || ".join(f"{var}.startsWith('{p}')" for p in PROTECTED_ANNOTATION_PREFIXES)
    exact = " || ".join(f"{var} == '{k}'" for k in sorted(PROTECTED_ANNOTATIONS))
    return f"(({prefixes}) && !({var} in variables.tenant)) || {exact}"


def test_the_denying_policy_protects_what_the_webhook_protects() -> None:
    spec, binding = policy("admission-policy.yaml", "gpushare-pod-annotations")
    assert cel_strings(variables(spec)["tenant"]) == TENANT_ANNOTATIONS
    for validation in spec["validations"]:
        assert protected_key("k") in " ".join(validation["expression"].split())
    assert binding["validationActions"] == ["Deny"]


def test_the_warning_policy_knows_what_gpushare_reads_and_never_denies() -> None:
    spec, binding = policy("admission-policy.yaml", "gpushare-pod-keys")
    found = variables(spec)
    assert cel_strings(found["tenant"]) == TENANT_ANNOTATIONS
    written, _, rest = found["known"].partition(" + ")
    assert rest == "variables.tenant"
    assert cel_strings(written) == {k for k in GPUSHARE_ANNOTATIONS if k.startswith("gpushare.io/")}
    assert cel_strings(found["labels"]) == KNOWN_POD_LABELS
    assert cel_strings(found["resources"]) == set(RESOURCES)
    assert binding["validationActions"] == ["Warn"] and spec["failurePolicy"] == "Ignore"


def matched(spec: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, operation)
        for rule in spec["matchConstraints"]["resourceRules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for operation in rule["operations"]
    }


def test_each_node_agent_is_held_to_its_own_node() -> None:
    slices, slices_binding = policy("rbac.yaml", "gpushare-node-agent-slices")
    node, node_binding = policy("rbac.yaml", "gpushare-node-agent-node")
    assert matched(slices) == {("resource.k8s.io", "resourceslices", op) for op in ("CREATE", "UPDATE", "DELETE")}
    assert {("", "nodes", "UPDATE"), ("", "nodes/status", "UPDATE")} <= matched(node)
    for spec, binding in ((slices, slices_binding), (node, node_binding)):
        (condition,) = spec["matchConditions"]
        assert condition["expression"] == f"request.userInfo.username == '{NODE_AGENT}'"
        assert NODE_NAME_EXTRA in variables(spec)["agentNode"]
        # a token without the node refused first, then the node compared
        assert spec["validations"][0]["expression"] == "variables.agentNode != ''"
        assert spec["failurePolicy"] == "Fail" and binding["validationActions"] == ["Deny"]
        assert not binding.get("matchResources")
    compared = " ".join(slices["validations"][1]["expression"].split())
    for field in ("spec.?nodeName", "spec.pool.name", "spec.driver"):
        assert f"variables.slice.{field}" in compared
