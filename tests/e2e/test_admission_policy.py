"""deploy/admission-policy.yaml on the real API server, with no webhook running: the ValidatingAdmissionPolicy
alone keeps a tenant from forging gpushare's annotations, lets the tenant's own card rule through, and
lets the extender's and the node agent's writes through (a GPU pod placed by them runs); it refuses and
admits exactly the keys the webhook does; and its Warn-only sibling names the keys gpushare would ignore.

The shipped bindings apply to every namespace; here their ``matchResources`` is narrowed to one namespace,
so the other e2e tests (which forge annotations as the cluster admin on purpose) keep their setting."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from gpushare.webhook.review import review
from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.allocation import CardSlice, format_allocation, parse_allocation
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_GPU_MODEL,
    ANN_MEM_ASSIGNED,
    KNOWN_POD_ANNOTATIONS,
    RESOURCE_MEM,
    protected_annotation,
)
from gpushare.sandbox.configfiles import SCHEDULER_CONFIG
from gpushare.sandbox.realcluster import RealCluster

from .conftest import API_POLL, TENANT_POD_RULES, denial, make_tenant, pod_manifest, wait_enforced

POLICY_FILE = SCHEDULER_CONFIG.parent / "admission-policy.yaml"
NAMESPACE = "gpushare-e2e-policy"
TENANT = "tenant"
TENANT_USER = f"system:serviceaccount:{NAMESPACE}:{TENANT}"


def shipped_policies() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each policy and its binding as deploy/ ships them."""
    docs = [doc for doc in yaml.safe_load_all(POLICY_FILE.read_text()) if doc]
    bindings = {d["spec"]["policyName"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    return [(d, bindings[d["metadata"]["name"]]) for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]


@pytest.fixture(scope="module")
def tenant(cluster: RealCluster, core: client.CoreV1Api) -> Iterator[client.CoreV1Api]:
    """The shipped policies, bound to NAMESPACE; yields the client of a service account there that may
    create, get, patch and delete pods, and patch their status."""
    admission = client.AdmissionregistrationV1Api(cluster.api)
    policies = shipped_policies()
    for _, binding in policies:
        binding["spec"]["matchResources"] = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
        }
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    cluster.wait_default_service_account(NAMESPACE)
    # some clusters let tenants write pod status; its writes carry metadata too
    status_rule = {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}
    api = make_tenant(cluster, NAMESPACE, TENANT, (*TENANT_POD_RULES, status_rule))
    for policy, binding in policies:
        admission.create_validating_admission_policy(policy)
        admission.create_validating_admission_policy_binding(binding)
    try:
        wait_enforced(api, NAMESPACE, "ValidatingAdmissionPolicy", "the API server to enforce the policy")
        yield client.CoreV1Api(api)
    finally:
        for policy, binding in policies:
            admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
            admission.delete_validating_admission_policy(policy["metadata"]["name"])
        core.delete_namespace(NAMESPACE, grace_period_seconds=0)
        wait_until(lambda: not core.list_namespaced_pod(NAMESPACE).items, 60, f"the pods in {NAMESPACE} to go",
                   API_POLL)  # fmt: skip
        api.close()


def test_the_policy_refuses_a_tenants_forged_allocation(
    tenant: client.CoreV1Api, core: client.CoreV1Api, cluster: RealCluster
) -> None:
    card = cluster.node_inventory("node-a").cards[0]
    forged = format_allocation({"main": (CardSlice(card.index, card.uuid, 4),)})
    manifest = pod_manifest("forged", annotations={ANN_ALLOCATION: forged}, namespace=NAMESPACE)
    message = denial(lambda: tenant.create_namespaced_pod(NAMESPACE, manifest))
    assert "only the gpushare scheduler extender and node agent may set or change" in message, message
    assert not core.list_namespaced_pod(NAMESPACE).items


def test_the_tenants_card_rule_passes_and_gpushares_own_writes_pass(
    tenant: client.CoreV1Api, core: client.CoreV1Api, cluster: RealCluster
) -> None:
    manifest = pod_manifest(
        "ruled", ({RESOURCE_MEM: 4},), node="node-a", annotations={ANN_GPU_MODEL: "A100-80GB"}, namespace=NAMESPACE
    )
    tenant.create_namespaced_pod(NAMESPACE, manifest)

    def running() -> Any:
        pod = core.read_namespaced_pod("ruled", NAMESPACE)
        return pod if pod.status.phase == "Running" else None

    pod = wait_until(running, 60, "the tenant's GPU pod to run", API_POLL)
    annotations = pod.metadata.annotations
    # written by the extender (its card choice) and by the node agent (Allocate's mark), both admitted
    assert ANN_ALLOCATION in annotations, annotations
    assert annotations.get(ANN_MEM_ASSIGNED) == "true", annotations
    ((held,),) = parse_allocation(annotations[ANN_ALLOCATION], "ruled").values()
    card = next(c for c in cluster.node_inventory("node-a").cards if c.uuid == held.uuid)
    assert card.model == "A100-80GB", card

    # the tenant still can't move its own pod to another card
    other = next(c for c in cluster.node_inventory("node-a").cards if c.uuid != card.uuid)
    claim = format_allocation({"main": (CardSlice(other.index, other.uuid, 4),)})
    message = denial(
        lambda: tenant.patch_namespaced_pod("ruled", NAMESPACE, {"metadata": {"annotations": {ANN_ALLOCATION: claim}}})
    )
    assert "may set or change gpushare's pod annotations" in message, message
    assert (
        core.read_namespaced_pod("ruled", NAMESPACE).metadata.annotations[ANN_ALLOCATION] == annotations[ANN_ALLOCATION]
    )


def test_the_policy_refuses_annotations_rewritten_through_pods_status(
    tenant: client.CoreV1Api, core: client.CoreV1Api, cluster: RealCluster
) -> None:
    """kube-apiserver takes a pod's metadata from a status write, so the policy covers pods/status too."""
    tenant.create_namespaced_pod(NAMESPACE, pod_manifest("plain", ({},), node="node-a", namespace=NAMESPACE))
    card = cluster.node_inventory("node-a").cards[0]
    forged = format_allocation({"main": (CardSlice(card.index, card.uuid, 4),)})
    message = denial(
        lambda: tenant.patch_namespaced_pod_status(
            "plain", NAMESPACE, {"metadata": {"annotations": {ANN_ALLOCATION: forged}}}
        )
    )
    assert "may set or change gpushare's pod annotations" in message, message
    assert ANN_ALLOCATION not in (core.read_namespaced_pod("plain", NAMESPACE).metadata.annotations or {})
    # a status write that leaves gpushare's annotations alone still goes through
    tenant.patch_namespaced_pod_status("plain", NAMESPACE, {"metadata": {"annotations": {"team": "a"}}})
    assert core.read_namespaced_pod("plain", NAMESPACE).metadata.annotations["team"] == "a"


#: every key gpushare knows, and some it doesn't, under its prefixes and outside them
EVERY_KEY = sorted(
    {
        *KNOWN_POD_ANNOTATIONS,
        "gpushare.io/gpu-modle",
        "gpushare.io/anything",
        "ALIYUN_COM_GPU_MEM_ANYTHING",
        "gpushare.oi/gpu-model",
        "example.com/team",
    }
)


@pytest.mark.parametrize("key", EVERY_KEY)
def test_the_policy_and_the_webhook_refuse_exactly_the_same_keys(tenant: client.CoreV1Api, key: str) -> None:
    """A tenant creating a pod with ``key``: the policy on the API server and the webhook's review agree,
    and refuse exactly gpushare's protected keys (require-memory-limit is the tenant's own)."""
    manifest = pod_manifest("key", annotations={key: "1"}, namespace=NAMESPACE)
    request = {"uid": "u", "operation": "CREATE", "userInfo": {"username": TENANT_USER}, "object": manifest}
    webhook_allows = review({"request": request}).allowed
    try:
        tenant.create_namespaced_pod(NAMESPACE, manifest, dry_run="All")
        policy_allows = True
    except client.ApiException as exc:
        assert exc.status == 403 and "ValidatingAdmissionPolicy" in (exc.body or ""), exc
        policy_allows = False
    assert (webhook_allows, policy_allows) == (not protected_annotation(key),) * 2


def warnings_of(tenant: client.CoreV1Api, manifest: dict[str, Any]) -> list[str]:
    """The warnings the API server returns on a dry-run create of ``manifest`` (kubectl prints them)."""
    reply = tenant.create_namespaced_pod(NAMESPACE, manifest, dry_run="All", _preload_content=False)
    return reply.headers.getlist("Warning")


def test_the_policy_warns_of_keys_gpushare_ignores(tenant: client.CoreV1Api) -> None:
    typo = pod_manifest("typo", annotations={"gpushare.oi/gpu-model": "A10"}, namespace=NAMESPACE)
    typo["metadata"]["labels"] = {"gpushare.io/gnag": "train"}
    typo["spec"]["containers"][0]["resources"]["limits"] = {"aliyun.com/gpumem": "4"}
    warnings = " ".join(warnings_of(tenant, typo))
    assert "gpushare ignores pod annotation(s) gpushare.oi/gpu-model" in warnings, warnings
    assert "gpushare ignores pod label(s) gpushare.io/gnag" in warnings, warnings
    assert "an aliyun.com/ resource gpushare doesn't offer" in warnings, warnings
    # a pod that carries only what gpushare reads gets none
    plain = pod_manifest("plain-keys", annotations={ANN_GPU_MODEL: "A100"}, namespace=NAMESPACE)
    reply = tenant.create_namespaced_pod(NAMESPACE, plain, dry_run="All", _preload_content=False)
    assert "Warning" not in reply.headers
