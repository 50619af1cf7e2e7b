"""The manifests' RBAC on a kube-apiserver with --authorization-mode=RBAC: the session's node agents
and extenders run as the service accounts of deploy/rbac.yaml (every other e2e test relies on that);
here, what those identities may and may not do, asked of the API server with their own tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpushare.advertiser.resourceslice import resource_slice
from kubernetes import client

from gpushare.contract.names import dra_slice_name
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.kube.transport import load_api
from gpushare.sandbox.realcluster import RealCluster

from .conftest import DRA_NODE, PLAIN_SCHEDULER, denial

NODE_AGENT = "gpushare-node-agent"
EXTENDER = "gpushare-extender"


#: what each identity must be able to do, as ``kubectl auth can-i`` asks it:
#: "verb resource[.group][/subresource]"
GRANTED = {
    NODE_AGENT: (
        "patch pods",
        "watch pods",
        "patch nodes",
        "create events",
        "patch events",
        "update resourceslices.resource.k8s.io",
        "get resourceclaims.resource.k8s.io",
    ),
    EXTENDER: (
        "create pods/binding",
        "patch nodes",
        "watch nodes",
        "watch resourceslices.resource.k8s.io",
        "watch resourceclaims.resource.k8s.io",
    ),
}
#: what each identity must be refused, asked the same way
REFUSED = {
    NODE_AGENT: (
        "create pods/binding",
        "list nodes",
        "delete pods",
        "update resourceclaims.resource.k8s.io/status",
        "delete resourceslices.resource.k8s.io",
    ),
    EXTENDER: ("delete pods", "get secrets", "update resourceclaims.resource.k8s.io/status"),
}


def allowed(cluster: RealCluster, account: str, ask: str) -> bool:
    verb, _, target = ask.partition(" ")
    target, _, subresource = target.partition("/")
    resource, _, group = target.partition(".")
    api = load_api(str(cluster.kubeconfig_of(account)))
    try:
        attributes = {
            "verb": verb,
            "group": group,
            "resource": resource,
            "subresource": subresource,
            "namespace": "default",
        }
        review = client.AuthorizationV1Api(api).create_self_subject_access_review(
            {"spec": {"resourceAttributes": attributes}}
        )
    finally:
        api.close()
    return bool(review.status.allowed)


def asks(table: dict[str, tuple[str, ...]], expected: bool) -> list[tuple[str, str, bool]]:
    return [(account, ask, expected) for account, account_asks in table.items() for ask in account_asks]


@pytest.mark.parametrize(("account", "ask", "expected"), [*asks(GRANTED, True), *asks(REFUSED, False)])
def test_service_accounts_hold_exactly_their_grants(
    cluster: RealCluster, account: str, ask: str, expected: bool
) -> None:
    assert allowed(cluster, account, ask) is expected


def test_the_components_run_with_the_service_account_tokens(cluster: RealCluster) -> None:
    for node in cluster.nodes.values():
        # each node's agent with a token of its own, bound to its Node
        kubeconfig = cluster.node_runner.agent_kubeconfig(node.name)
        assert kubeconfig != cluster.kubeconfig_of(NODE_AGENT)
        assert node.agent is not None and str(kubeconfig) in node.agent.argv
        assert node.agent_ready()
    for control in cluster.controls:
        if control.scheduler_name == PLAIN_SCHEDULER:
            assert control.extender is None
            continue
        assert control.extender is not None and str(cluster.kubeconfig_of(EXTENDER)) in control.extender.argv


# --- each node agent writes only its own node's ResourceSlice and Node (deploy/rbac.yaml's policies) ----

OWN, OTHER = "node-a", "node-b"
#: what the attack published: a card of 800 GiB, at a pool generation above the real one
HUGE = simulated_cards(OTHER, "1xA100-80GB:819200")


@pytest.fixture(scope="module")
def agent_of_own(cluster: RealCluster) -> Iterator[client.ApiClient]:
    """The API client of node OWN's agent, with its token (bound to its Node)."""
    api = load_api(str(cluster.node_runner.agent_kubeconfig(OWN)))
    yield api
    api.close()


def forged_slice(node: str, pool: str, generation: int = 1000) -> dict:
    body = resource_slice(node, HUGE, GIB, generation)
    body["metadata"]["name"] = f"forged-{node}-{pool}"
    body["spec"]["pool"]["name"] = pool
    return body


@pytest.mark.parametrize(("node", "pool"), [(OTHER, OTHER), (OWN, OTHER), (OTHER, OWN)])
def test_a_node_agent_may_not_publish_a_slice_for_another_node(
    agent_of_own: client.ApiClient, node: str, pool: str
) -> None:
    resources = client.ResourceV1Api(agent_of_own)
    message = denial(lambda: resources.create_resource_slice(forged_slice(node, pool)))
    assert f"the node agent of node {OWN} may write only its own node's ResourceSlice" in message, message


def test_a_node_agent_may_not_rewrite_another_nodes_slice(agent_of_own: client.ApiClient) -> None:
    resources = client.ResourceV1Api(agent_of_own)
    live = resources.read_resource_slice(dra_slice_name(DRA_NODE))  # get: granted, as to every agent
    live.spec.pool.generation += 1000
    message = denial(lambda: resources.replace_resource_slice(live.metadata.name, live))
    assert f"not one of node {DRA_NODE}" in message, message


def test_a_node_agent_may_not_patch_another_node(agent_of_own: client.ApiClient, core: client.CoreV1Api) -> None:
    nodes = client.CoreV1Api(agent_of_own)
    patch = {"metadata": {"annotations": {"gpushare.io/inventory": "forged"}}}
    message = denial(lambda: nodes.patch_node(OTHER, patch))
    assert f"the node agent of node {OWN} may not change node {OTHER}" in message, message
    assert (core.read_node(OTHER).metadata.annotations or {}).get("gpushare.io/inventory") != "forged"


def test_a_node_agent_writes_its_own_nodes_slice_and_node(agent_of_own: client.ApiClient) -> None:
    # dry runs: admission decides as for a real write, and the cluster's other tests see nothing
    own = resource_slice(OWN, simulated_cards(OWN, "1xT4:15360"), GIB, 1)
    client.ResourceV1Api(agent_of_own).create_resource_slice(own, dry_run="All")
    client.CoreV1Api(agent_of_own).patch_node(OWN, {"metadata": {"labels": {"team": "a"}}}, dry_run="All")


def test_a_node_agent_token_bound_to_no_node_writes_no_node(cluster: RealCluster) -> None:
    api = load_api(str(cluster.kubeconfig_of(NODE_AGENT)))
    try:
        message = denial(lambda: client.CoreV1Api(api).patch_node(OWN, {"metadata": {"labels": {"team": "a"}}}))
        assert "the node agent's token names no node" in message, message
    finally:
        api.close()
