"""The manifests' RBAC on a kube-apiserver with --authorization-mode=RBAC: the session's node agents
and extenders run as the service accounts of deploy/rbac.yaml (every other e2e test relies on that);
here, what those identities may and may not do, asked of the API server with their own tokens."""

from __future__ import annotations

import pytest
from kubernetes import client

from gpushare.kube.transport import load_api
from gpushare.sandbox.realcluster import RealCluster

NODE_AGENT = "gpushare-node-agent"
EXTENDER = "gpushare-extender"


def allowed(cluster: RealCluster, account: str, verb: str, resource: str, subresource: str = "") -> bool:
    api = load_api(str(cluster.kubeconfig_of(account)))
    try:
        attributes = {"verb": verb, "resource": resource, "subresource": subresource, "namespace": "default"}
        review = client.AuthorizationV1Api(api).create_self_subject_access_review(
            {"spec": {"resourceAttributes": attributes}}
        )
    finally:
        api.close()
    return bool(review.status.allowed)


@pytest.mark.parametrize(
    ("account", "verb", "resource", "subresource", "expected"),
    [
        (NODE_AGENT, "patch", "pods", "", True),
        (NODE_AGENT, "watch", "pods", "", True),
        (NODE_AGENT, "patch", "nodes", "", True),
        (NODE_AGENT, "create", "events", "", True),
        (NODE_AGENT, "patch", "events", "", True),
        (NODE_AGENT, "create", "pods", "binding", False),
        (NODE_AGENT, "list", "nodes", "", False),
        (NODE_AGENT, "delete", "pods", "", False),
        (EXTENDER, "create", "pods", "binding", True),
        (EXTENDER, "patch", "nodes", "", True),
        (EXTENDER, "watch", "nodes", "", True),
        (EXTENDER, "delete", "pods", "", False),
        (EXTENDER, "get", "secrets", "", False),
    ],
)
def test_service_accounts_hold_exactly_their_grants(
    cluster: RealCluster, account: str, verb: str, resource: str, subresource: str, expected: bool
) -> None:
    assert allowed(cluster, account, verb, resource, subresource) is expected


def test_the_components_run_with_the_service_account_tokens(cluster: RealCluster) -> None:
    for node in cluster.nodes.values():
        assert node.agent is not None and str(cluster.kubeconfig_of(NODE_AGENT)) in node.agent.argv
        assert node.agent_ready()
    for control in cluster.controls:
        assert control.extender is not None and str(cluster.kubeconfig_of(EXTENDER)) in control.extender.argv
