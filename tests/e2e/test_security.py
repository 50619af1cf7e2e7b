"""On the real cluster: a pod can't forge its way onto a card (the CRI shim's own defence), the admission
webhook keeps tenants off the scheduler's annotations, and kube-scheduler reaches the extender over TLS
with its client certificate, as deploy/scheduler-config.yaml ships it. The ValidatingAdmissionPolicy,
which needs no webhook, is test_admission_policy.py's."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.allocation import CardSlice, format_allocation, parse_allocation
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_IDX,
    ENV_MEM_CONTAINER,
    ENV_VISIBLE_DEVICES,
    NODE_ANN_PENDING_BINDS,
    RESOURCE_MEM,
    VISIBLE_DEVICES_VOID,
)
from gpushare.contract.pending import parse_pending_binds
from gpushare.inspection.views import build_cluster
from gpushare.kube.objects import list_nodes, list_pods
from gpushare.kube.transport import load_api
from gpushare.sandbox.certs import Certs, make_certs
from gpushare.sandbox.configfiles import SCHEDULER_CONFIG
from gpushare.sandbox.launch import Process, free_port
from gpushare.sandbox.realcluster import RealCluster

from .conftest import (
    API_POLL,
    PLAIN_SCHEDULER,
    Pods,
    assert_sees_assigned_cards,
    denial,
    make_tenant,
    pod_manifest,
    remove_tenant,
    wait_enforced,
)

GUARDED = "gpushare-e2e-guarded"
GUARD_LABEL = {"gpushare.io/e2e-webhook": "on"}
WEBHOOK_CONFIG = "gpushare-e2e-pod-annotations"
TENANT = "tenant"


# --- 2: a pod that asks for no GPU gets none, whatever its annotations say -----------------------------


@pytest.mark.parametrize("forgery", ["allocation", "alibaba-index-and-env"])
def test_a_pod_without_a_gpu_request_gets_no_card_from_forged_annotations(pods: Pods, forgery: str) -> None:
    inventory = pods.cluster.node_inventory("node-b")
    card = inventory.cards[0]
    units = inventory.units_of(card)
    if forgery == "allocation":
        forged = {ANN_ALLOCATION: format_allocation({"main": (CardSlice(card.index, card.uuid, units),)})}
    else:
        forged = {ANN_MEM_IDX: str(card.index)}
    # created by the cluster admin where no webhook looks: the node's own checks must hold
    manifest = pod_manifest(pods.name("forged"), ({},), node="node-b", annotations=forged)
    if forgery != "allocation":
        manifest["spec"]["containers"][0]["env"] = [{"name": ENV_MEM_CONTAINER, "value": str(units)}]
    forger = pods.create(manifest)
    pods.wait_running(forger)
    assert pods.env(forger)[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID

    # the whole card is still free for a pod that asks for it: nothing counted the forger
    legit = pods.create(pod_manifest(pods.name("whole-card"), ({RESOURCE_MEM: units},), node="node-b"))
    pods.wait_running(legit)
    assert_sees_assigned_cards(pods, legit)
    assert pods.env(legit)[ENV_VISIBLE_DEVICES] == card.uuid
    (view,) = [n for n in build_cluster(list_nodes(pods.cluster.api), list_pods(pods.cluster.api)).nodes
               if n.name == "node-b"]  # fmt: skip
    assert next(v for v in view.cards if v.index == card.index).allocated == units


# --- 4: the admission webhook ---------------------------------------------------------------------------


def tls_client(certs: Certs, with_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certs.ca)
    if with_cert:
        context.load_cert_chain(certs.client.cert, certs.client.key)
    return context


def https_status(port: int, path: str, context: ssl.SSLContext) -> int:
    try:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return 0


@pytest.fixture(scope="module")
def webhook(cluster: RealCluster, core: client.CoreV1Api) -> Iterator[client.ApiClient]:
    """``gpushare webhook`` registered for the namespace GUARDED only; yields the tenant's API client,
    a service account there that may create, patch and delete pods."""
    certs = make_certs(cluster.workdir / "webhook-tls", ())
    port = free_port()
    server = Process(
        "gpushare-webhook",
        [sys.executable, "-m", "gpushare.cli", "webhook", "--port", str(port),
         "--tls-cert", certs.server.cert, "--tls-key", certs.server.key],
        cluster.workdir / "gpushare-webhook.log",
    ).start()  # fmt: skip
    admission = client.AdmissionregistrationV1Api(cluster.api)
    try:
        wait_until(
            lambda: server.check() or https_status(port, "/readyz", tls_client(certs, False)) == 200,
            30, "the webhook to serve", API_POLL,
        )  # fmt: skip
        shipped = next(d for d in yaml.safe_load_all((SCHEDULER_CONFIG.parent / "webhook.yaml").read_text())
                       if d["kind"] == "ValidatingWebhookConfiguration")  # fmt: skip
        hook = shipped["webhooks"][0]
        hook["clientConfig"] = {
            "url": f"https://127.0.0.1:{port}/validate",
            "caBundle": base64.b64encode(Path(certs.ca).read_bytes()).decode(),
        }
        # only the test's namespace, so the other tests' deliberate forgeries go through
        hook["namespaceSelector"] = {"matchLabels": GUARD_LABEL}
        shipped["metadata"]["name"] = WEBHOOK_CONFIG
        if not any(ns.metadata.name == GUARDED for ns in core.list_namespace().items):
            core.create_namespace({"metadata": {"name": GUARDED, "labels": GUARD_LABEL}})
        cluster.wait_default_service_account(GUARDED)
        tenant = make_tenant(cluster, GUARDED, TENANT)
        admission.create_validating_webhook_configuration(shipped)
        try:
            wait_enforced(tenant, GUARDED, "denied the request", "the API server to call the webhook")
            yield tenant
        finally:
            admission.delete_validating_webhook_configuration(WEBHOOK_CONFIG)
            clear_guarded(core)
            remove_tenant(cluster, GUARDED, TENANT)
            tenant.close()
    finally:
        server.stop()


def clear_guarded(core: client.CoreV1Api) -> None:
    """Deletes every pod in GUARDED and waits until the API server has none, so no card stays held for the
    tests that follow."""
    for pod in core.list_namespaced_pod(GUARDED).items:
        core.delete_namespaced_pod(pod.metadata.name, GUARDED, grace_period_seconds=0)
    wait_until(lambda: not core.list_namespaced_pod(GUARDED).items, 30, f"the pods in {GUARDED} to go", API_POLL)


@pytest.fixture
def guarded_pods(webhook: client.ApiClient, core: client.CoreV1Api) -> Iterator[client.ApiClient]:
    """The tenant's API client; every pod the test made in GUARDED is gone when it ends."""
    try:
        yield webhook
    finally:
        clear_guarded(core)


def test_a_tenant_cant_create_a_pod_carrying_an_allocation(webhook: client.ApiClient, cluster: RealCluster) -> None:
    card = cluster.node_inventory("node-a").cards[0]
    forged = format_allocation({"main": (CardSlice(card.index, card.uuid, 4),)})
    manifest = pod_manifest("forged-create", annotations={ANN_ALLOCATION: forged}, namespace=GUARDED)
    message = denial(lambda: client.CoreV1Api(webhook).create_namespaced_pod(GUARDED, manifest))
    assert "denied the request" in message, message
    assert f"may not create pod {GUARDED}/forged-create" in message and ANN_ALLOCATION in message, message
    assert not client.CoreV1Api(cluster.api).list_namespaced_pod(GUARDED).items


def test_a_tenant_cant_rewrite_a_running_pods_allocation_but_the_extender_can(
    guarded_pods: client.ApiClient, cluster: RealCluster, core: client.CoreV1Api
) -> None:
    tenant = client.CoreV1Api(guarded_pods)
    manifest = pod_manifest("guarded-gpu", ({RESOURCE_MEM: 4},), node="node-a", namespace=GUARDED)
    # no protected annotation: the webhook lets it in, then the extender binds and annotates it
    tenant.create_namespaced_pod(GUARDED, manifest)

    def running() -> Any:
        pod = core.read_namespaced_pod("guarded-gpu", GUARDED)
        return pod if pod.status.phase == "Running" else None

    pod = wait_until(running, 60, "the tenant's GPU pod to run", API_POLL)
    allocation = parse_allocation(pod.metadata.annotations[ANN_ALLOCATION], "guarded-gpu")
    (slices,) = allocation.values()
    other = next(card for card in cluster.node_inventory("node-a").cards if card.uuid != slices[0].uuid)
    claim = format_allocation({"main": (CardSlice(other.index, other.uuid, slices[0].units),)})

    def tenant_patch() -> None:
        tenant.patch_namespaced_pod("guarded-gpu", GUARDED, {"metadata": {"annotations": {ANN_ALLOCATION: claim}}})

    message = denial(tenant_patch)
    assert f"may not change annotations on pod {GUARDED}/guarded-gpu" in message, message
    assert (
        core.read_namespaced_pod("guarded-gpu", GUARDED).metadata.annotations[ANN_ALLOCATION]
        == (pod.metadata.annotations[ANN_ALLOCATION])
    )
    # the extender's service account writes the same annotations through the same webhook
    extender = load_api(str(cluster.kubeconfig_of("gpushare-extender")))
    try:
        client.CoreV1Api(extender).patch_namespaced_pod(
            "guarded-gpu", GUARDED, {"metadata": {"annotations": {ANN_MEM_ASSUME_TIME: "1"}}}
        )
    finally:
        extender.close()
    assert core.read_namespaced_pod("guarded-gpu", GUARDED).metadata.annotations[ANN_MEM_ASSUME_TIME] == "1"


# --- 6: kube-scheduler to extender over TLS with a client certificate -----------------------------------


def test_kube_scheduler_reaches_the_extender_with_the_shipped_tls_config(cluster: RealCluster, pods: Pods) -> None:
    shipped = yaml.safe_load(SCHEDULER_CONFIG.read_text())["extenders"][0]["tlsConfig"]
    for control in cluster.controls:
        config = yaml.safe_load((cluster.workdir / f"scheduler-{control.scheduler_name}.yaml").read_text())
        if control.scheduler_name == PLAIN_SCHEDULER:
            assert "extenders" not in config
            continue
        assert len(config["extenders"]) == 2  # GPU pods' entry, and the one that scores pods without GPUs
        for extender in config["extenders"]:
            assert extender["enableHTTPS"] is True and extender["urlPrefix"].startswith("https://")
            assert extender["tlsConfig"]["serverName"] == shipped["serverName"]
            assert set(extender["tlsConfig"]) == set(shipped)
    name = pods.create(pod_manifest(pods.name("over-tls"), ({RESOURCE_MEM: 2},), node="node-a"))
    pods.wait_running(name)
    assert_sees_assigned_cards(pods, name)


def bind(cluster: RealCluster, context: ssl.SSLContext, pod: dict[str, Any], node: str) -> dict[str, Any]:
    """POST the extender's /bind as kube-scheduler would."""
    body = {"PodName": pod["metadata"]["name"], "PodNamespace": "default", "PodUID": pod["metadata"]["uid"],
            "Node": node}  # fmt: skip
    conn = http.client.HTTPSConnection("127.0.0.1", cluster.controls[0].extender_port, context=context, timeout=10)
    try:
        conn.request("POST", "/bind", json.dumps(body), {"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def test_a_client_without_the_schedulers_certificate_gets_nothing(cluster: RealCluster) -> None:
    assert cluster.extender_certs is not None
    stranger = tls_client(cluster.extender_certs, with_cert=False)
    conn = http.client.HTTPSConnection("127.0.0.1", cluster.controls[0].extender_port, context=stranger, timeout=10)
    # TLS 1.3 reports the refused client certificate on the first read after the handshake
    with pytest.raises((ssl.SSLError, ConnectionError)):
        conn.request("POST", "/bind", "{}", {"Content-Type": "application/json"})
        conn.getresponse()
    conn.close()


def test_the_extender_binds_only_gpu_pods_onto_nodes_they_accept(cluster: RealCluster, pods: Pods) -> None:
    assert cluster.extender_certs is not None
    scheduler = tls_client(cluster.extender_certs, with_cert=True)
    # no scheduler serves "nobody": the pods stay pending until someone binds them
    no_gpu = pods.create(pod_manifest(pods.name("no-gpu"), ({},), scheduler="nobody"))
    pinned = pods.create(pod_manifest(pods.name("pinned"), ({RESOURCE_MEM: 2},), node="node-b", scheduler="nobody"))
    refused = bind(cluster, scheduler, pods.get(no_gpu), "node-a")
    assert no_gpu in refused.get("Error", "") and "requests no gpushare resource" in refused["Error"], refused
    refused = bind(cluster, scheduler, pods.get(pinned), "node-a")
    assert pinned in refused.get("Error", "") and "node-a" in refused["Error"], refused
    for name in (no_gpu, pinned):
        pod = pods.get(name)
        assert not pod["spec"].get("nodeName"), f"{name} was bound"
        assert ANN_ALLOCATION not in (pod["metadata"].get("annotations") or {}), f"{name} was annotated"


def test_a_second_bind_for_a_bound_pod_changes_nothing(
    cluster: RealCluster, core: client.CoreV1Api, pods: Pods
) -> None:
    """kube-scheduler binds a pod again when its first call timed out; so may anyone with its certificate."""
    assert cluster.extender_certs is not None
    scheduler = tls_client(cluster.extender_certs, with_cert=True)
    name = pods.create(pod_manifest(pods.name("rebound"), ({RESOURCE_MEM: 40},), node="node-a"))
    pods.wait_running(name)
    pod = pods.get(name)
    uid = pod["metadata"]["uid"]

    def recorded() -> tuple[dict[str, str | None], Any]:
        ledger = parse_pending_binds((core.read_node("node-a").metadata.annotations or {})[NODE_ANN_PENDING_BINDS])
        annotations = pods.get(name)["metadata"].get("annotations") or {}
        placed = {key: annotations.get(key) for key in (ANN_ALLOCATION, ANN_MEM_IDX, ANN_MEM_ASSUME_TIME)}
        return placed, ledger.get(uid)

    before = recorded()
    assert before[1] is not None, "the pod's bind is in node-a's ledger"
    assert bind(cluster, scheduler, pod, "node-a") == {"Error": ""}
    refused = bind(cluster, scheduler, pod, "node-b")
    assert "bound to node node-a already" in refused.get("Error", ""), refused
    assert recorded() == before
    # the pod's card keeps counting where its annotations say: a pod asking for the rest of it goes elsewhere
    (slices,) = pods.allocation(name).values()
    beside = pods.create(pod_manifest(pods.name("beside"), ({RESOURCE_MEM: 41},), node="node-a"))
    pods.wait_running(beside)
    (theirs,) = pods.allocation(beside).values()
    assert {s.uuid for s in theirs}.isdisjoint(s.uuid for s in slices)


# --- 4, defence in depth: the extender's ledger on the node, with no admission control installed ------


def test_a_pod_that_rewrites_its_allocation_keeps_its_real_card(pods: Pods, cluster: RealCluster) -> None:
    """In the default namespace no webhook looks: the cluster admin's client stands in for a tenant who
    rewrites a running pod's allocation. The extender's record on the node (which tenants can't write)
    still says which card the pod holds: the next whole-card pod lands on the other card, and the CRI
    shim refuses to (re)create the forger's container on the card it claims."""
    inventory = cluster.node_inventory("node-a")
    big = [card for card in inventory.cards if inventory.units_of(card) == 80]
    manifest = pod_manifest(pods.name("mover"), ({RESOURCE_MEM: 80},), node="node-a")
    # exits after a few seconds and is re-created, so the shim sees it again after the rewrite
    manifest["spec"]["restartPolicy"] = "Always"
    manifest["spec"]["containers"][0]["command"] = ["sh", "-c", "sleep 3; exit 1"]
    mover = pods.create(manifest)
    pods.wait_running(mover)
    (real,) = pods.allocation(mover)["main"]
    other = next(card for card in big if card.uuid != real.uuid)
    forged = format_allocation({"main": (CardSlice(other.index, other.uuid, 80),)})
    pods.core.patch_namespaced_pod(mover, "default", {"metadata": {"annotations": {ANN_ALLOCATION: forged}}})

    second = pods.create(pod_manifest(pods.name("second"), ({RESOURCE_MEM: 80},), node="node-a"))
    pods.wait_running(second)
    assert [s.uuid for s in pods.allocation(second)["main"]] == [other.uuid], "placed on the forger's real card"
    assert pods.env(second)[ENV_VISIBLE_DEVICES] == other.uuid

    def refused() -> str | None:
        statuses = (pods.get(mover).get("status") or {}).get("containerStatuses") or []
        waiting = (statuses[0].get("state") or {}).get("waiting") or {} if statuses else {}
        message = waiting.get("message") or ""
        return message if "recorded" in message else None

    message = wait_until(refused, 90, "the CRI shim to refuse the forger's re-created container", API_POLL)
    assert f"claim card {other.index} ({other.uuid})" in message and real.uuid in message, message
