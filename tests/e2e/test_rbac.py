"""The manifests' RBAC on a kube-apiserver with --authorization-mode=RBAC: the session's node agents
and extenders run as the service accounts of deploy/rbac.yaml (every other e2e test relies on that);
here, what those identities may and may not do, asked of the API server with their own tokens."""

from __future__ import annotations

import pytest
from kubernetes import client

from gpushare.kube.transport import load_api
from gpushare.sandbox.realcluster import RealCluster

from .conftest import PLAIN_SCHEDULER

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
        assert node.agent is not None and str(cluster.kubeconfig_of(NODE_AGENT)) in node.agent.argv
        assert node.agent_ready()
    for control in cluster.controls:
        if control.scheduler_name == PLAIN_SCHEDULER:
            assert control.extender is None
            continue
        assert control.extender is not None and str(cluster.kubeconfig_of(EXTENDER)) in control.extender.argv
