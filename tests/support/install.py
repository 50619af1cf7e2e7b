"""gpushare installed into a :class:`~gpushare.sandbox.shippedcluster.ShippedCluster` by the guide's
commands (tests/install): the cluster and what the tests saw before the install (:class:`Installed`),
GPU pods made one a second while something rolls (:class:`PodStream`), a watch on the nodes' Ready
condition (:class:`ReadyWatch`), ``kill -9`` of a node agent's processes (:func:`kill_agent`) and the
measurements the tests print and keep in a JSON file (:class:`Measurements`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.names import ANN_ALLOCATION, NODE_ANN_INVENTORY, PLACEMENT_ANNOTATIONS, RESOURCE_MEM
from gpushare.kube.objects import get_pod
from gpushare.sandbox import image
from gpushare.sandbox.containerd import descendants
from gpushare.sandbox.realcluster import as_sandbox_pod
from gpushare.sandbox.shippedcluster import CONTROL_PLANE, ShippedCluster
from support.cards import assert_sees_assigned_cards
from support.guide import Guide, workspace
from support.waiting import wait_until

NODES = (("node-a", "mixed"), ("node-b", "dgx-a100"))
NAMESPACE = "gpushare-system"
#: what every install's values file holds. Besides the guide's image, it points the chart at the fake
#: driver where the GPU operator puts the driver's library (the nodes' machines bind it there). The
#: image is the one imported into each node's containerd: there is no registry here.
BASE_VALUES: dict[str, Any] = {
    "image": {"repository": "gpushare"},
    "nodeAgent": {"nvmlLibrary": "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"},
}
AGENT_SELECTOR = "app.kubernetes.io/name=gpushare-node-agent"
AGENT_CONTAINER = "node-agent"
POD_TIMEOUT = 90.0
API_POLL = 0.2


@dataclass
class Measurements:
    """What the tests measured, printed as each is taken (``pytest -s`` shows it) and kept in
    :attr:`path` as JSON, one key per measurement."""

    path: Path
    taken: dict[str, Any] = field(default_factory=dict)

    def record(self, key: str, value: Any) -> None:
        self.taken[key] = value
        self.path.write_text(json.dumps(self.taken, indent=2, sort_keys=True) + "\n")
        print(f"\n[measured] {key}: {json.dumps(value, sort_keys=True)}  ({self.path})", flush=True)


@dataclass
class Installed:
    """The cluster, the guide run on it, and what the tests saw before anything was installed."""

    cluster: ShippedCluster
    guide: Guide
    core: client.CoreV1Api
    measured: Measurements
    #: per node: its labels and annotations before the install
    nodes_before: dict[str, tuple[dict[str, str], dict[str, str]]] = field(default_factory=dict)
    #: cluster-scoped objects by kind, namespaces, and kube-system's leases, before the install
    cluster_before: dict[str, set[str]] = field(default_factory=dict)
    #: per node: its kubelet's configuration file before the install
    kubelet_configs: dict[str, str] = field(default_factory=dict)
    pods: list[str] = field(default_factory=list)

    def pod(self, name: str) -> dict[str, Any]:
        return get_pod(self.cluster.api, "default", name)

    def create(self, manifest: dict[str, Any]) -> str:
        self.core.create_namespaced_pod("default", as_sandbox_pod(manifest))
        self.pods.append(manifest["metadata"]["name"])
        return str(manifest["metadata"]["name"])

    def kubectl_apply(self, *files: Path) -> str:
        """``kubectl apply -f`` each file, as the administrator; the pods it names are the tests' to delete."""
        for path in files:
            self.pods.append(yaml.safe_load(path.read_text())["metadata"]["name"])
        arguments = " ".join(f"-f {path}" for path in files)
        done = self.cluster.run_on(CONTROL_PLANE, f"kubectl apply {arguments}", self.guide.cwd)
        assert done.returncode == 0, done.stdout
        return done.stdout

    def inventory(self, node: str) -> NodeInventory:
        annotations = self.core.read_node(node).metadata.annotations or {}
        return parse_inventory(annotations.get(NODE_ANN_INVENTORY, ""), node)

    def wait_running(self, name: str, timeout: float = POD_TIMEOUT) -> dict[str, Any]:
        def running() -> dict[str, Any] | None:
            pod = self.pod(name)
            status = pod.get("status") or {}
            assert status.get("phase") != "Failed", f"pod {name} failed: {status.get('reason')} {status.get('message')}"
            return pod if status.get("phase") == "Running" else None

        return wait_until(running, timeout, f"pod {name} to run", API_POLL)

    def assert_sees_its_cards(self, name: str) -> None:
        pod = self.pod(name)
        node = self.cluster.nodes[pod["spec"]["nodeName"]]
        assert_sees_assigned_cards(
            pod, self.inventory(node.name), lambda container: node.container_env("default", name, container)
        )

    def agent(self, node: str) -> client.V1Pod:
        """The node agent's pod on ``node`` (the newest, while a roll replaces it)."""
        found = self.core.list_namespaced_pod(
            NAMESPACE, label_selector=AGENT_SELECTOR, field_selector=f"spec.nodeName={node}"
        ).items
        assert found, f"no node agent pod on {node}"
        return max(found, key=lambda pod: pod.metadata.creation_timestamp)

    def delete_pods(self) -> None:
        """Delete the tests' pods in ``default`` and wait until they are gone."""
        for name in self.pods:
            with contextlib.suppress(client.ApiException):
                self.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
        wait_until(lambda: not self.core.list_namespaced_pod("default").items, 60, "the pods to go", API_POLL)
        self.pods.clear()


def cluster_scoped(api: Any) -> dict[str, set[str]]:
    """What an install may add outside its namespace: cluster-scoped objects by kind, the namespaces,
    and kube-system's leases (kube-scheduler's leader lock) and role bindings (who reads its ConfigMaps)."""
    rbac, admission = client.RbacAuthorizationV1Api(api), client.AdmissionregistrationV1Api(api)
    leases = client.CoordinationV1Api(api).list_namespaced_lease("kube-system").items
    bindings = rbac.list_namespaced_role_binding("kube-system").items
    return {
        "namespaces": {n.metadata.name for n in client.CoreV1Api(api).list_namespace().items},
        "clusterroles": {r.metadata.name for r in rbac.list_cluster_role().items},
        "clusterrolebindings": {b.metadata.name for b in rbac.list_cluster_role_binding().items},
        "validatingwebhookconfigurations": {
            w.metadata.name for w in admission.list_validating_webhook_configuration().items
        },
        "validatingadmissionpolicies": {p.metadata.name for p in admission.list_validating_admission_policy().items},
        "validatingadmissionpolicybindings": {
            b.metadata.name for b in admission.list_validating_admission_policy_binding().items
        },
        "mutatingadmissionpolicies": {p.metadata.name for p in admission.list_mutating_admission_policy().items},
        "mutatingadmissionpolicybindings": {
            b.metadata.name for b in admission.list_mutating_admission_policy_binding().items
        },
        "kube-system leases": {lease.metadata.name for lease in leases},
        "kube-system rolebindings": {binding.metadata.name for binding in bindings},
    }


@contextlib.contextmanager
def installing(values: Mapping[str, Any], measurements: Path) -> Iterator[Installed]:
    """A started :class:`ShippedCluster` with the image imported on each node, a checkout to run the
    guide from with ``values`` in ``my-values.yaml``, and what the cluster held before; stopped and
    removed on exit. Measurements go to ``measurements``."""
    workdir = Path(tempfile.mkdtemp(prefix="gs-helm-", dir="/tmp"))
    cluster = ShippedCluster(NODES, workdir, images=[image.built()])
    try:
        cluster.start()
        cwd = workspace(workdir / "checkout")
        (cwd / "my-values.yaml").write_text(yaml.safe_dump(dict(values)))
        core = client.CoreV1Api(cluster.api)
        state = Installed(cluster, Guide(cluster, cwd), core, Measurements(measurements))
        for node in core.list_node().items:
            state.nodes_before[node.metadata.name] = (dict(node.metadata.labels), dict(node.metadata.annotations))
        state.cluster_before = cluster_scoped(cluster.api)
        state.kubelet_configs = {n.name: (n.kubelet_dir / "config.yaml").read_text() for n in cluster.nodes.values()}
        yield state
    finally:
        cluster.stop()
        remove_tree(workdir)


def remove_tree(path: Path) -> None:
    """Remove the cluster's directory; the kernel may still be releasing the last mounts of its machines'
    namespaces for a moment after their processes have ended."""

    def removed() -> bool:
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()

    wait_until(removed, 10, f"{path} to be removed", API_POLL)


def gpu_pod(name: str, mem: int, node: str | None = None, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A pod of one container asking for ``mem`` units of GPU memory (0: no GPU), on ``node`` if given."""
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "main",
                "image": "busybox:1.36",
                "command": ["sleep", "3600"],
                "resources": {"limits": {RESOURCE_MEM: mem}} if mem else {},
            }
        ],
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": dict(labels or {})},
        "spec": spec,
    }


def kill_agent(installed: Installed, node: str) -> list[int]:
    """``kill -9`` of every process of the node agent's container on ``node`` (its first process, found
    through the node's containerd, and everything below it); the PIDs killed, once they are gone."""
    pid = installed.cluster.nodes[node].container_pid(NAMESPACE, installed.agent(node).metadata.name, AGENT_CONTAINER)
    killed = [pid, *descendants(pid)]
    for each in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)

    def gone() -> bool:
        # a killed process lingers as a zombie until its parent, the runc shim, reaps it
        return all(not Path(f"/proc/{p}").exists() or _zombie(p) for p in killed)

    wait_until(gone, 10, f"the node agent's processes on {node} to end", 0.05)
    return killed


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def settled_phase(installed: Installed, name: str) -> str | None:
    """``Running``, or ``Failed`` with kubelet's reason and message; None while the pod is on its way."""
    status = installed.pod(name).get("status") or {}
    if status.get("phase") == "Failed":
        return f"Failed ({status.get('reason')}: {status.get('message')})"
    return "Running" if status.get("phase") == "Running" else None


def restarts(pod: client.V1Pod) -> int:
    return sum(status.restart_count for status in pod.status.container_statuses or [])


def ready(pod: client.V1Pod) -> bool:
    statuses = pod.status.container_statuses or []
    return bool(statuses) and all(status.ready for status in statuses)


class ReadyWatch:
    """Reads the nodes' Ready condition every :data:`API_POLL` seconds until stopped, and keeps every
    moment one of them was not Ready (``with ReadyWatch(core, nodes) as watch: ...; watch.not_ready``)."""

    def __init__(self, core: client.CoreV1Api, nodes: list[str]) -> None:
        self.core, self.nodes = core, nodes
        self.not_ready: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(API_POLL):
            for node in self.nodes:
                conditions = self.core.read_node(node).status.conditions or []
                status = next((c.status for c in conditions if c.type == "Ready"), "missing")
                if status != "True":
                    self.not_ready.append(f"{node} Ready={status} at {time.strftime('%H:%M:%S')}")


@dataclass
class PodStream:
    """GPU pods made one a second (at most ``limit``) while something else happens, each remembered with
    when it was made and when it was first seen Running (polled every :data:`API_POLL` seconds)."""

    installed: Installed
    prefix: str
    limit: int
    mems: tuple[int, ...] = (2, 4)
    made: dict[str, float] = field(default_factory=dict)
    running: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._make, daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]
        self._made_all = threading.Event()

    def __enter__(self) -> PodStream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._made_all.set()
        self._threads[0].join()

    def _make(self) -> None:
        for i in range(self.limit):
            if self._made_all.wait(1.0):
                return
            name = self.installed.create(gpu_pod(f"{self.prefix}-{i}", self.mems[i % len(self.mems)]))
            self.made[name] = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(API_POLL):
            for pod in self.installed.core.list_namespaced_pod("default").items:
                name, phase = pod.metadata.name, pod.status.phase
                if name in self.made and name not in self.running and phase == "Running":
                    self.running[name] = time.monotonic()
                elif name in self.made and phase == "Failed":
                    self.failed[name] = f"{pod.status.reason}: {pod.status.message}"

    def settle(self, timeout: float = 2 * POD_TIMEOUT) -> None:
        """Wait until every pod made runs or has failed, then stop watching."""
        try:
            wait_until(
                lambda: set(self.made) <= set(self.running) | set(self.failed),
                timeout,
                f"the {self.prefix} pods to run",
                API_POLL,
            )
        finally:
            self._stop.set()
            self._threads[1].join()

    def wrong_cards(self) -> dict[str, str]:
        """Per running pod that doesn't see exactly the cards the scheduler wrote for it: what it sees."""
        wrong = {}
        for name in self.running:
            try:
                self.installed.assert_sees_its_cards(name)
            except AssertionError as exc:
                wrong[name] = str(exc)
        return wrong

    def summary(self, wrong: Mapping[str, str]) -> dict[str, Any]:
        """The counts and the longest wait, given :meth:`wrong_cards`."""
        waits = [self.running[name] - made for name, made in self.made.items() if name in self.running]
        return {
            "created": len(self.made),
            "running": len(self.running),
            "failed": len(self.failed),
            "wrong_card": len(wrong),
            "longest_wait_to_running_s": round(max(waits, default=0.0), 2),
        }


#: per running GPU pod: its node, its containers' IDs and the annotations that say its cards
RunningState = dict[str, tuple[str, list[str], dict[str, str]]]


def running_state(installed: Installed) -> RunningState:
    """Every running pod of the tests that holds cards the extender wrote for it."""
    state = {}
    for pod in installed.core.list_namespaced_pod("default").items:
        annotations = dict(pod.metadata.annotations or {})
        if pod.status.phase == "Running" and ANN_ALLOCATION in annotations:
            ids = sorted(s.container_id for s in pod.status.container_statuses or [])
            cards = {key: annotations[key] for key in PLACEMENT_ANNOTATIONS if key in annotations}
            state[pod.metadata.name] = (pod.spec.node_name, ids, cards)
    return state


def assert_kept_their_cards(installed: Installed, before: RunningState) -> None:
    """The pods of ``before`` run on, in the same containers, with the same annotations and cards."""
    after = running_state(installed)
    assert {name: after.get(name) for name in before} == before
    for name in before:
        installed.assert_sees_its_cards(name)


def assert_survives_kill_9(installed: Installed, node: str, key: str) -> None:
    """``kill -9`` of the node agent on ``node``: the nodes stay Ready throughout, kubelet restarts the
    agent's container in place and it is Ready again, a pod asking for no GPU made on ``node`` while the
    agent is down runs, a GPU pod made then runs on the cards written for it (it may wait for them), and
    the pods that ran before keep theirs. What it took is recorded under ``key``."""
    core = installed.core
    agent = installed.agent(node)
    before, running = restarts(agent), running_state(installed)
    with ReadyWatch(core, list(installed.cluster.nodes)) as watch:
        killed = kill_agent(installed, node)
        began = time.monotonic()
        # the gap as the cluster knows it: kubelet reports the agent's container ended (a pod bound in
        # the instant before, while its device plugin is already gone, kubelet would refuse for good)
        wait_until(
            lambda: not ready(core.read_namespaced_pod(agent.metadata.name, NAMESPACE)),
            POD_TIMEOUT,
            f"kubelet to report the node agent on {node} not Ready",
            API_POLL,
        )
        noticed = time.monotonic() - began
        gap = installed.create(gpu_pod(f"{key.replace('_', '-')}-gap", 4, node=node))
        plain = installed.create(gpu_pod(f"{key.replace('_', '-')}-no-gpu", 0, node=node))

        def back() -> bool:
            pod = core.read_namespaced_pod(agent.metadata.name, NAMESPACE)
            return restarts(pod) > before and ready(pod)

        wait_until(back, 2 * POD_TIMEOUT, f"the node agent on {node} to be restarted and Ready", API_POLL)
        agent_back = time.monotonic() - began
        phase = wait_until(lambda: settled_phase(installed, gap), 2 * POD_TIMEOUT, f"pod {gap} to run", API_POLL)
        gap_settled = time.monotonic() - began
        plain_phase = wait_until(lambda: settled_phase(installed, plain), POD_TIMEOUT, f"pod {plain} to run", API_POLL)
    installed.measured.record(
        key,
        {
            "processes_killed": len(killed),
            "agent_reported_not_ready_s": round(noticed, 1),
            "agent_ready_again_s": round(agent_back, 1),
            "pod_made_in_the_gap": f"{phase} after {gap_settled:.1f} s",
            "pod_without_gpu_made_in_the_gap": plain_phase,
            "node_not_ready_samples": len(watch.not_ready),
        },
    )
    assert not watch.not_ready, watch.not_ready
    assert installed.agent(node).metadata.uid == agent.metadata.uid, "the agent's pod was replaced, not restarted"
    assert_kept_their_cards(installed, running)
    assert plain_phase == "Running", f"pod {plain}, made while the agent was down: {plain_phase}"
    assert phase == "Running", f"pod {gap}, made while the agent was down: {phase}"
    installed.assert_sees_its_cards(gap)
