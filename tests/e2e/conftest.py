"""One real Kubernetes v1.37.2 cluster for the e2e tests, stopped once they are done (before
tests/install starts a cluster of its own): kube-apiserver with RBAC, the ServiceAccount admission
plugin and the manifests' service accounts, kube-controller-manager, two kube-scheduler/extender pairs
and one kube-scheduler with no extender, and six simulated nodes, each a mount namespace with
containerd 2, the gpushare node agent and a kubelet: two with simulated cards; two on the fake
libnvidia-ml (a DGX A100 whose driver enforces per-cgroup memory limits, its kubelet giving each pod a
cgroup, and a machine with an older driver); and two whose agents serve the DRA driver
gpu.gpushare.io, one with every card and one with one of its two cards.

Without root, the built binaries or the packages, every test here is skipped and the session header
says why in one line.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support.cards import assert_sees_assigned_cards as assert_container_env
from support.waiting import wait_until

from gpushare.contract.allocation import CardSlice
from gpushare.contract.names import ANN_MEM_IDX, RESOURCE_MEM
from gpushare.holdings.pod import pod_allocation
from gpushare.kube.objects import get_pod
from gpushare.kube.transport import load_api
from gpushare.sandbox.realcluster import RealCluster, as_sandbox_pod, realcluster_available

E2E_DIR = Path(__file__).parent
UNAVAILABLE = realcluster_available()
#: ``gpushare node --gpus nvml`` on the fake libnvidia-ml presenting a DGX A100 (8 x A100-SXM4-80GB)
NVML_NODE = "node-dgx"
#: only pods that tolerate it land on the NVML node, so the other tests' placements don't change
NVML_TAINT = {"key": "gpushare.io/e2e-nvml", "value": "true", "effect": "NoSchedule"}
#: seconds a card that hit a critical XID stays unhealthy on the NVML node
NVML_RECOVERY = 4.0
#: ``gpushare node --gpus nvml`` on a fake driver older than 615: no per-cgroup memory limits
OLD_DRIVER_NODE = "node-olddrv"
#: every card offered through the DRA driver gpu.gpushare.io (none through the device plugin)
DRA_NODE = "node-dra"
#: card 1 offered through DRA, card 0 through the device plugin and the extender
MIXED_NODE = "node-mixed"
#: only pods that tolerate it land on the mixed node
MIXED_TAINT = {"key": "gpushare.io/e2e-mixed", "value": "true", "effect": "NoSchedule"}
NODES = (
    ("node-a", "2xA100-80GB:81920,1xT4:15360"),
    ("node-b", "1xA100-40GB:40960,2xA10:24576"),
    (NVML_NODE, "nvml:dgx-a100"),
    (OLD_DRIVER_NODE, "nvml:old-driver"),
    (DRA_NODE, "2xA100-80GB:81920,2xA10:24576"),
    (MIXED_NODE, "2xA100-40GB:40960"),
)
#: a kube-scheduler with no extender in its configuration: DRA claims need none
PLAIN_SCHEDULER = "no-extender"
#: a second kube-scheduler with its own extender replica, for concurrent binds
SECOND_SCHEDULER = "gpushare-second"
POD_TIMEOUT = 60.0
#: seconds between polls of the API server
API_POLL = 0.2
_names = itertools.count()


def pytest_report_header() -> str | None:
    if UNAVAILABLE:
        return f"real-cluster e2e tests SKIPPED: {UNAVAILABLE}"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if UNAVAILABLE:
        skip = pytest.mark.skip(reason=f"no real cluster here: {UNAVAILABLE}")
        for item in items:
            if E2E_DIR in Path(str(item.fspath)).parents:
                item.add_marker(skip)


@pytest.fixture(scope="package")
def cluster() -> Iterator[RealCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="gs-e2e-", dir="/tmp"))
    real = RealCluster(
        NODES,
        workdir,
        rbac=True,
        scheduler_names=("default-scheduler", SECOND_SCHEDULER),
        nvml_recovery_seconds=NVML_RECOVERY,
        node_taints={
            **{node: ("{key}={value}:{effect}".format(**NVML_TAINT),) for node in (NVML_NODE, OLD_DRIVER_NODE)},
            MIXED_NODE: ("{key}={value}:{effect}".format(**MIXED_TAINT),),
        },
        plain_schedulers=(PLAIN_SCHEDULER,),
        dra_nodes={DRA_NODE: "all", MIXED_NODE: "1"},
    )
    try:
        real.start()
        yield real
    finally:  # a cluster that failed to start is stopped and removed too
        real.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="package")
def core(cluster: RealCluster) -> client.CoreV1Api:
    return client.CoreV1Api(cluster.api)


def pod_manifest(
    name: str,
    limits: Sequence[Mapping[str, int]] = ({RESOURCE_MEM: 4},),
    *,
    node: str | None = None,
    scheduler: str | None = None,
    annotations: Mapping[str, str] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    """A busybox pod with one container per entry of ``limits`` (``main``, ``c1``, ...)."""
    containers = [
        {
            "name": "main" if i == 0 else f"c{i}",
            "image": "busybox:1.36",
            "command": ["sleep", "3600"],
            "resources": {"limits": dict(limit)},
        }
        for i, limit in enumerate(limits)
    ]
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": containers}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if scheduler:
        spec["schedulerName"] = scheduler
    if node in (NVML_NODE, OLD_DRIVER_NODE):
        spec["tolerations"] = [NVML_TAINT]
    if node == MIXED_NODE:
        spec["tolerations"] = [MIXED_TAINT]
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return as_sandbox_pod({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})


class Pods:
    """Creates pods and deletes every one of them when the test ends."""

    def __init__(self, cluster: RealCluster, core: client.CoreV1Api) -> None:
        self.cluster = cluster
        self.core = core
        self.created: list[str] = []

    def name(self, prefix: str) -> str:
        return f"{prefix}-{next(_names)}"

    def create(self, manifest: Mapping[str, Any]) -> str:
        name = manifest["metadata"]["name"]
        self.core.create_namespaced_pod("default", manifest)
        self.created.append(name)
        return name

    def get(self, name: str) -> dict[str, Any]:
        return get_pod(self.cluster.api, "default", name)

    def phase(self, name: str) -> str:
        return (self.get(name).get("status") or {}).get("phase", "")

    def wait_running(self, name: str, timeout: float = POD_TIMEOUT) -> dict[str, Any]:
        """The pod once Running; fails at once, with kubelet's reason, if the pod failed."""

        def running() -> dict[str, Any] | None:
            pod = self.get(name)
            status = pod.get("status") or {}
            if status.get("phase") == "Failed":
                raise AssertionError(f"pod {name} failed: {status.get('reason')}: {status.get('message')}")
            return pod if status.get("phase") == "Running" else None

        try:
            return wait_until(running, timeout, f"pod {name} to run", API_POLL)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; it is {self.why_not(name)}") from None

    def why_not(self, name: str) -> str:
        status = self.get(name).get("status") or {}
        conditions = [
            f"{x.get('type')}={x.get('status')} {x.get('message', '')}" for x in status.get("conditions") or []
        ]
        return f"{status.get('phase')}: {'; '.join(conditions)}"

    def delete_all(self) -> None:
        for name in self.created:
            try:
                self.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        self.created.clear()

    def env(self, name: str, container: str = "main") -> dict[str, str]:
        """The environment the container's process really has."""
        pod = self.get(name)
        return self.cluster.container_env(pod["spec"]["nodeName"], "default", name, container)

    def allocation(self, name: str) -> dict[str, tuple[CardSlice, ...]]:
        """The cards the scheduler wrote for each container, named by UUID through the node's inventory."""
        pod = self.get(name)
        allocation = pod_allocation(pod, self.cluster.node_inventory(pod["spec"]["nodeName"]).cards)
        assert allocation, f"pod {name} carries no card assignment"
        return allocation


@pytest.fixture
def pods(cluster: RealCluster, core: client.CoreV1Api) -> Iterator[Pods]:
    made = Pods(cluster, core)
    try:
        yield made
    finally:
        made.delete_all()


def assert_sees_assigned_cards(pods: Pods, name: str) -> None:
    """Every GPU container of the pod sees exactly the cards the scheduler wrote for it."""
    pod = pods.get(name)
    inventory = pods.cluster.node_inventory(pod["spec"]["nodeName"])
    assert_container_env(pod, inventory, lambda container: pods.env(name, container))


#: what a tenant may do with pods in its namespace
TENANT_POD_RULES = ({"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "patch", "delete"]},)


def make_tenant(
    cluster: RealCluster, namespace: str, name: str, rules: Sequence[Mapping[str, Any]] = TENANT_POD_RULES
) -> client.ApiClient:
    """A service account ``name`` in ``namespace`` bound to a Role of ``rules``: its API client."""
    core, rbac = client.CoreV1Api(cluster.api), client.RbacAuthorizationV1Api(cluster.api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": list(rules)})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    })  # fmt: skip
    token = core.create_namespaced_service_account_token(
        name, namespace, {"spec": {"audiences": [], "expirationSeconds": 3600}}
    ).status.token
    return load_api(str(cluster.write_kubeconfig(f"system:serviceaccount:{namespace}:{name}", token)))


def remove_tenant(cluster: RealCluster, namespace: str, name: str) -> None:
    core, rbac = client.CoreV1Api(cluster.api), client.RbacAuthorizationV1Api(cluster.api)
    for delete in (rbac.delete_namespaced_role_binding, rbac.delete_namespaced_role,
                   core.delete_namespaced_service_account):  # fmt: skip
        delete(name, namespace)


def forgery_refused(tenant: client.CoreV1Api, namespace: str, marker: str) -> bool:
    """Whether admission control has picked up its configuration: the tenant's dry run of a pod carrying
    a forged card index is refused with ``marker`` in the reply."""
    forged = pod_manifest("probe", annotations={ANN_MEM_IDX: "0"}, namespace=namespace)
    try:
        tenant.create_namespaced_pod(namespace, forged, dry_run="All")
    except client.ApiException as exc:
        return marker in (exc.body or "")
    return False


def wait_enforced(tenant: client.ApiClient, namespace: str, marker: str, what: str) -> None:
    """Wait until ``tenant``'s forgeries in ``namespace`` are refused with ``marker`` in the reply."""
    wait_until(lambda: forgery_refused(client.CoreV1Api(tenant), namespace, marker), 30, what, API_POLL)


def denial(call: Callable[[], Any]) -> str:
    """The API server's message when ``call`` is refused for its content (403 from a webhook or a
    policy); fails the test if it succeeds."""
    try:
        call()
    except client.ApiException as exc:
        assert exc.status == 403, exc
        return json.loads(exc.body).get("message", "") if exc.body else str(exc)
    raise AssertionError("the API server accepted what admission control should have denied")


def scheduling_failure(core: client.CoreV1Api, name: str) -> str:
    """The message of the pod's FailedScheduling event, once kube-scheduler has recorded one."""

    def message() -> str | None:
        events = core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name={name},reason=FailedScheduling"
        ).items
        return events[-1].message if events else None

    return wait_until(message, POD_TIMEOUT, f"a FailedScheduling event for {name}", API_POLL)
