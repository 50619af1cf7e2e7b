"""deploy/scheduler.yaml (the chart's scheduler.enabled) on a real kube-apiserver (no kubelets, no
kube-scheduler): the API server takes every object of it, its MutatingAdmissionPolicy gives GPU pods the
profile gpushare-scheduler and leaves every other pod with the scheduler it names, and the scheduler's
service account may do what its kube-scheduler needs (its own lease, the authentication ConfigMap) and no
more of leases than that."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, utils
from support.realapi import real_api_server
from support.waiting import wait_until

from gpushare.contract.names import (
    DEFAULT_SCHEDULER_NAME,
    NAMESPACE_LABEL_SCHEDULER,
    NAMESPACE_SCHEDULER_OPT_OUT,
    RESOURCE_COUNT,
    RESOURCE_MEM,
    SCHEDULER_NAME,
)
from gpushare.process import end_group
from gpushare.sandbox import binaries
from gpushare.sandbox.certs import make_certs
from gpushare.sandbox.controlplane import SYSTEM_NAMESPACE
from gpushare.sandbox.launch import free_port
from gpushare.sandbox.realcluster import RealCluster

SCHEDULER_MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "scheduler.yaml"
TENANT, OPTED_OUT = "team-a", "team-legacy"
ACCOUNT = f"system:serviceaccount:{SYSTEM_NAMESPACE}:gpushare-scheduler"


@pytest.fixture(scope="module")
def real() -> Iterator[RealCluster]:
    """A real API server with RBAC, deploy/'s namespace and deploy/scheduler.yaml applied, and the
    namespaces TENANT and OPTED_OUT (the latter labelled out of the policy)."""
    with real_api_server(rbac=True) as real:
        utils.create_from_yaml(real.api, str(SCHEDULER_MANIFEST))
        core = client.CoreV1Api(real.api)
        for name, labels in ((TENANT, {}), (OPTED_OUT, {NAMESPACE_LABEL_SCHEDULER: NAMESPACE_SCHEDULER_OPT_OUT})):
            core.create_namespace({"metadata": {"name": name, "labels": labels}})
            real.wait_default_service_account(name)
        # the API server applies a policy shortly after it is created
        wait_until(lambda: scheduler_of(real.api, TENANT, gpu_pod()) == SCHEDULER_NAME, 30, "the scheduler policy", 0.2)
        yield real


@pytest.fixture
def api(real: RealCluster) -> client.ApiClient:
    return real.api


def gpu_pod(resource: str = RESOURCE_MEM, init: bool = False, where: str = "limits") -> dict[str, Any]:
    container = {"name": "main", "image": "busybox:1.36", "resources": {where: {resource: "1"}}}
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox:1.36"}]}
    if init:
        spec["initContainers"] = [{**container, "name": "setup"}]
    else:
        spec["containers"] = [container]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "pod-"}, "spec": spec}


def scheduler_of(api: client.ApiClient, namespace: str, pod: dict[str, Any]) -> str:
    """The schedulerName the API server gives ``pod`` created in ``namespace`` (a dry run: admission runs,
    nothing is stored)."""
    created = client.CoreV1Api(api).create_namespaced_pod(namespace, pod, dry_run="All")
    return created.spec.scheduler_name


@pytest.mark.parametrize(
    ("resource", "init"), [(RESOURCE_MEM, False), (RESOURCE_COUNT, False), (RESOURCE_MEM, True), (RESOURCE_COUNT, True)]
)
def test_a_gpu_pod_gets_the_gpushare_scheduler(api: client.ApiClient, resource: str, init: bool) -> None:
    """In a container's limits or an init container's."""
    assert scheduler_of(api, TENANT, gpu_pod(resource, init)) == SCHEDULER_NAME


def test_a_gpu_request_without_its_limit_is_refused_by_the_api_server(api: client.ApiClient) -> None:
    """Why the policy reads the limits alone: every pod asking for gpushare's resources has them there."""
    with pytest.raises(client.ApiException) as refused:
        scheduler_of(api, TENANT, gpu_pod(where="requests"))
    assert refused.value.status == 422 and "Limit must be set" in refused.value.body


def test_a_pod_without_gpus_keeps_the_default_scheduler(api: client.ApiClient) -> None:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
    assert scheduler_of(api, TENANT, pod) == DEFAULT_SCHEDULER_NAME


def test_a_gpu_pod_in_an_opted_out_namespace_keeps_the_default_scheduler(api: client.ApiClient) -> None:
    assert scheduler_of(api, OPTED_OUT, gpu_pod()) == DEFAULT_SCHEDULER_NAME


def test_a_gpu_pod_naming_another_scheduler_keeps_it(api: client.ApiClient) -> None:
    pod = gpu_pod()
    pod["spec"]["schedulerName"] = "volcano"
    assert scheduler_of(api, TENANT, pod) == "volcano"


def test_a_gpu_pod_naming_the_default_scheduler_is_given_the_gpushare_one(api: client.ApiClient) -> None:
    """What a pod gets when it names none: the policy can't tell the two apart, so both go to gpushare."""
    pod = gpu_pod()
    pod["spec"]["schedulerName"] = DEFAULT_SCHEDULER_NAME
    assert scheduler_of(api, TENANT, pod) == SCHEDULER_NAME


def test_the_schedulers_own_pods_are_placed_by_the_default_scheduler(api: client.ApiClient) -> None:
    (deployment,) = [d for d in yaml.safe_load_all(SCHEDULER_MANIFEST.read_text()) if d and d["kind"] == "Deployment"]
    template = copy.deepcopy(deployment["spec"]["template"])
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "generateName": "s-"}}
    assert scheduler_of(api, SYSTEM_NAMESPACE, {**pod, "spec": template["spec"]}) == DEFAULT_SCHEDULER_NAME


@pytest.mark.parametrize(
    ("verb", "resource", "namespace", "name", "group", "expected"),
    [
        # its own leader lease, and no other's
        ("create", "leases", SYSTEM_NAMESPACE, "", "coordination.k8s.io", True),
        ("get", "leases", SYSTEM_NAMESPACE, SCHEDULER_NAME, "coordination.k8s.io", True),
        ("update", "leases", SYSTEM_NAMESPACE, SCHEDULER_NAME, "coordination.k8s.io", True),
        ("update", "leases", SYSTEM_NAMESPACE, "gpushare-other", "coordination.k8s.io", False),
        # its secure port's authentication: the client CA kube-apiserver publishes
        ("get", "configmaps", "kube-system", "extension-apiserver-authentication", "", True),
        ("get", "configmaps", "kube-system", "other", "", False),
        # what any kube-scheduler does
        ("create", "pods/binding", TENANT, "", "", True),
        ("list", "nodes", "", "", "", True),
        ("list", "csinodes", "", "", "storage.k8s.io", True),
        ("create", "tokenreviews", "", "", "authentication.k8s.io", True),
    ],
)
def test_the_schedulers_account_may_do_what_kube_scheduler_needs(
    api: client.ApiClient, verb: str, resource: str, namespace: str, name: str, group: str, expected: bool
) -> None:
    sub = ""
    if "/" in resource:
        resource, sub = resource.split("/")
    attributes = {"verb": verb, "resource": resource, "subresource": sub, "namespace": namespace, "name": name}
    review = {
        "spec": {
            "user": ACCOUNT,
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{SYSTEM_NAMESPACE}"],
            "resourceAttributes": {**attributes, "group": group},
        }
    }
    assert client.AuthorizationV1Api(api).create_subject_access_review(review).status.allowed is expected


def shipped_scheduler() -> tuple[dict[str, Any], list[str]]:
    """deploy/scheduler.yaml's kube-scheduler configuration, and its Deployment's gpushare arguments."""
    docs = [d for d in yaml.safe_load_all(SCHEDULER_MANIFEST.read_text()) if d]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return yaml.safe_load(config_map["data"]["config.yaml"]), [*container["command"][1:], *container["args"]]


@pytest.mark.skipif(
    binaries.missing(("kube-scheduler",)) is not None, reason=f"{binaries.missing(('kube-scheduler',))}"
)
def test_the_charts_kube_scheduler_leads_and_places_pods_as_its_service_account(
    real: RealCluster, tmp_path: Path
) -> None:
    """The Deployment's command line, run here as its service account (a kubeconfig with the account's token
    where the pod would use its own): kube-scheduler takes the lease it was given and binds a pod of its
    profile to a node. The pod asks for no GPU, so no extender is called (the one entry that scores every
    pod is ignorable, and nothing listens where it points)."""
    certs = make_certs(tmp_path / "certs", ("gpushare-extender.gpushare-system.svc",))
    config, command = shipped_scheduler()
    request = {"spec": {"audiences": [], "expirationSeconds": 3600}}
    core = client.CoreV1Api(real.api)
    token = core.create_namespaced_service_account_token("gpushare-scheduler", SYSTEM_NAMESPACE, request).status.token
    kubeconfig = real.write_kubeconfig("gpushare-scheduler", token)
    config["clientConnection"] = {"kubeconfig": str(kubeconfig)}
    files = {"certFile": certs.client.cert, "keyFile": certs.client.key, "caFile": certs.ca}
    for entry in config["extenders"]:
        entry["tlsConfig"] = {**entry["tlsConfig"], **files}
    template = tmp_path / "config.yaml"
    template.write_text(yaml.safe_dump(config))
    args = [a for a in command if not a.startswith(("--config=", "--write-config="))]
    args[1:1] = [f"--config={template}", f"--write-config={tmp_path / 'written.yaml'}"]
    args.insert(1, f"--kube-scheduler={binaries.built('kube-scheduler')}")
    # where the pod's service account would do: delegated authentication and authorization, and its port
    args += [f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}"]
    args += ["--bind-address=127.0.0.1", f"--secure-port={free_port()}"]
    env = {**os.environ, "GPUSHARE_EXTENDER_SERVICE_HOST": "127.0.0.1", "GPUSHARE_EXTENDER_SERVICE_PORT": "9"}
    log = tmp_path / "kube-scheduler.log"
    node = {"metadata": {"name": "cpu-1"}}
    core.create_node(node)
    allocatable = {"cpu": "4", "memory": "8Gi", "pods": "110"}
    ready = [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test"}]
    core.patch_node_status(
        "cpu-1", {"status": {"allocatable": allocatable, "capacity": allocatable, "conditions": ready}}
    )
    pod = {
        "metadata": {"name": "placed"},
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "containers": [{"name": "main", "image": "busybox:1.36"}],
            # the API server taints a new Node so until its node lifecycle controller, not run here, sees it Ready
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpushare.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        leases = client.CoordinationV1Api(real.api)

        def leader() -> str:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return leases.read_namespaced_lease(SCHEDULER_NAME, SYSTEM_NAMESPACE).spec.holder_identity or ""
            except client.ApiException as exc:
                if exc.status == 404:
                    return ""
                raise

        wait_until(leader, 60, "kube-scheduler to take its lease", 0.2)
        core.create_namespaced_pod(TENANT, pod)
        try:
            placed = wait_until(lambda: core.read_namespaced_pod("placed", TENANT).spec.node_name, 60, "a bind", 0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; kube-scheduler's log ends: {log.read_text()[-3000:]}") from None
        assert placed == "cpu-1"
        assert "forbidden" not in log.read_text().lower(), log.read_text()[-3000:]
    finally:
        end_group(proc, 30)
