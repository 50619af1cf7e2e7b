"""deploy/rbac.yaml's policies on a real kube-apiserver (no kubelets): the node agent's service account,
with a token bound to its Node, writes its own node's ResourceSlice and Node and no other node's, and
with a token bound to no node writes neither; a token bound to a pod on the node, as the DaemonSet pod's
projected token is, carries the node too. tests/e2e/test_rbac.py asks the same of the running agents'
own tokens on the real cluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gpushare.advertiser.resourceslice import resource_slice
from kubernetes import client
from support.realapi import real_api_server
from support.waiting import wait_until

from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.kube.transport import load_api
from gpushare.sandbox.controlplane import NODE_AGENT_USER, SYSTEM_NAMESPACE

OWN, OTHER = "gpu-1", "gpu-2"
Agents = tuple[client.ApiClient, client.ApiClient, client.ApiClient]


@pytest.fixture(scope="module")
def agents() -> Iterator[Agents]:
    """The API clients of node OWN's agent (its token bound to its Node), of the node agent's account
    with a token bound to nothing, and with a token bound to a pod of its DaemonSet's on node OWN."""
    with real_api_server(rbac=True) as real:
        bound = load_api(str(real.control_plane.register_node_agent(OWN)))
        real.control_plane.register_node_agent(OTHER)
        unbound = load_api(str(real.kubeconfig_of(NODE_AGENT_USER)))
        core = client.CoreV1Api(real.api)
        pod = core.create_namespaced_pod(SYSTEM_NAMESPACE, {
            "metadata": {"name": "gpushare-node-agent-x"},
            "spec": {"serviceAccountName": NODE_AGENT_USER, "nodeName": OWN,
                     "containers": [{"name": "node-agent", "image": "gpushare:0.1.0"}]},
        })  # fmt: skip
        ref = {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name, "uid": pod.metadata.uid}
        request = {"spec": {"audiences": [], "expirationSeconds": 3600, "boundObjectRef": ref}}
        token = core.create_namespaced_service_account_token(NODE_AGENT_USER, SYSTEM_NAMESPACE, request).status.token
        in_pod = load_api(str(real.write_kubeconfig("node-agent-pod", token)))
        try:
            # the API server enforces a policy shortly after it is created
            wait_until(lambda: refused(lambda: patch(unbound, OWN)), 30, "the node agent policies", 0.2)
            yield bound, unbound, in_pod
        finally:
            for api in (bound, unbound, in_pod):
                api.close()


def patch(api: client.ApiClient, node: str) -> Any:
    return client.CoreV1Api(api).patch_node(node, {"metadata": {"annotations": {"gpushare.io/inventory": "x"}}})


def refused(call: Any) -> str:
    """The policy's message when ``call`` is refused (403), else ""."""
    try:
        call()
    except client.ApiException as exc:
        if exc.status == 403 and "ValidatingAdmissionPolicy" in (exc.body or ""):
            return exc.body
        raise
    return ""


def slice_of(node: str, pool: str, name: str) -> dict[str, Any]:
    body = resource_slice(node, simulated_cards(node, "1xA100-80GB:819200"), GIB, 1000)
    body["metadata"]["name"] = name
    body["spec"]["pool"]["name"] = pool
    return body


@pytest.mark.parametrize(("node", "pool"), [(OTHER, OTHER), (OWN, OTHER), (OTHER, OWN)])
def test_no_slice_for_another_node(agents: Agents, node: str, pool: str) -> None:
    bound, *_ = agents
    body = slice_of(node, pool, f"forged-{node}-{pool}")
    message = refused(lambda: client.ResourceV1Api(bound).create_resource_slice(body))
    assert f"the node agent of node {OWN} may write only its own node" in message


def test_no_patch_of_another_node(agents: Agents) -> None:
    bound, *_ = agents
    assert f"may not change node {OTHER}" in refused(lambda: patch(bound, OTHER))


def test_its_own_slice_and_node(agents: Agents) -> None:
    bound, *_ = agents
    resources = client.ResourceV1Api(bound)
    created = resources.create_resource_slice(slice_of(OWN, OWN, f"{OWN}-own"))
    created.spec.pool.generation += 1
    resources.replace_resource_slice(created.metadata.name, created)
    assert patch(bound, OWN).metadata.annotations["gpushare.io/inventory"] == "x"


def test_a_token_bound_to_no_node_writes_neither(agents: Agents) -> None:
    _, unbound, _ = agents
    assert "names no node" in refused(lambda: patch(unbound, OWN))
    body = slice_of(OWN, OWN, "unbound")
    assert "names no node" in refused(lambda: client.ResourceV1Api(unbound).create_resource_slice(body))


def test_a_token_bound_to_a_pod_on_the_node_writes_that_nodes_objects_alone(agents: Agents) -> None:
    *_, in_pod = agents
    assert patch(in_pod, OWN).metadata.annotations["gpushare.io/inventory"] == "x"
    assert f"the node agent of node {OWN} may not change node {OTHER}" in refused(lambda: patch(in_pod, OTHER))
