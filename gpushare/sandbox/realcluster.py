"""A real Kubernetes cluster on this machine, at the version ``build_kube.sh`` pins: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler with the gpushare extender (:mod:`~gpushare.sandbox.controlplane`),
and per simulated node a private containerd, the gpushare node agent (simulated cards, CRI shim in front of
containerd) and a kubelet, in a mount namespace of its own (:mod:`~gpushare.sandbox.realnode`). The nodes
share the host's network namespace; each node's pods get a bridge and a private subnet of their own
(:mod:`~gpushare.sandbox.podnetwork`), deleted on stop. Every port is a free one on 127.0.0.1 but the
kubelets', each on its node's own address (:class:`~gpushare.sandbox.podnetwork.NodeAddresses`), where
kube-apiserver reaches it for logs and exec with a client certificate, the only way in.

:class:`RealCluster` starts the parts in order and stops every process any of them started
(:mod:`~gpushare.sandbox.launch`); the configuration files they read are rendered by pure functions
(:mod:`~gpushare.sandbox.configfiles`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY
from gpushare.process import signals_ignored
from gpushare.sandbox import binaries
from gpushare.sandbox.binaries import KUBE_BINARIES
from gpushare.sandbox.certs import Certs
from gpushare.sandbox.configfiles import Identity
from gpushare.sandbox.containerd import PAUSE_IMAGE, TEST_IMAGE, build_busybox_image, containerd_available
from gpushare.sandbox.controlplane import Control, ControlPlane, Schedulers
from gpushare.sandbox.hostlease import Lease, claim_first_free
from gpushare.sandbox.launch import ClusterError, Launcher, Process, processes_using
from gpushare.sandbox.nodecgroups import make_cgroup_root
from gpushare.sandbox.nvmllimits import describe as describe_limits
from gpushare.sandbox.nvmllimits import read_limits
from gpushare.sandbox.podnetwork import (
    NODE_BLOCK_COUNT,
    NODE_BLOCK_LEASE,
    NodeAddresses,
    bridge_name,
    cni_plugins_missing,
    node_link,
    pod_subnet,
    remove_bridge,
)
from gpushare.sandbox.realnode import NodeRunner, RealNode, stop_nodes

#: the image name the pods in deploy/examples use
EXAMPLE_IMAGE = "docker.io/library/busybox:1.36"
#: containerd's socket sits three levels below the workdir, and unix socket paths end at 107 bytes
MAX_WORKDIR = 60


def realcluster_available() -> str | None:
    """None when a real cluster can run here, else why not (a reason to skip or fall back)."""
    return (
        containerd_available()
        or binaries.missing((*KUBE_BINARIES, "etcd"))
        or binaries.host_tool_missing(("unshare", "nsenter", "mount", "openssl", "ip"))
        or cni_plugins_missing()
    )


def as_sandbox_pod(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A pod manifest as the sandbox applies it: deletion needs no grace period, and quantities become
    strings as the API serves them."""
    from gpushare.sandbox.examples import with_string_quantities

    body = with_string_quantities(manifest)
    body.setdefault("spec", {})["terminationGracePeriodSeconds"] = 0
    return body


@dataclass
class RealCluster:
    """Start with :meth:`start`, stop with :meth:`stop` (which ends every process it started)."""

    nodes_spec: Sequence[tuple[str, str]]
    workdir: Path
    rbac: bool = False
    policy: str = ""
    #: one kube-scheduler and one extender replica per name; pods choose with ``spec.schedulerName``
    scheduler_names: Sequence[str] = ("default-scheduler",)
    #: kube-scheduler reaches its extender over HTTPS with a client certificate, as deploy/ ships it
    extender_tls: bool = True
    #: ``--nvml-recovery-seconds`` of the fake-NVML nodes' agents
    nvml_recovery_seconds: float = 300.0
    #: per node name, taints its kubelet registers with (``key=value:Effect``), so only pods that
    #: tolerate them land there
    node_taints: Mapping[str, Sequence[str]] = field(default_factory=dict)
    #: kube-controller-manager's ``--controllers``
    controllers: Sequence[str] = ("*",)
    #: users whose completed requests kube-apiserver writes to :attr:`audit_log` (verb, resource, user)
    audited_users: Sequence[str] = ()
    #: kube-schedulers with no extender in their configuration (for DRA claims)
    plain_schedulers: Sequence[str] = ()
    #: per node whose agent also serves the DRA driver gpu.gpushare.io, its ``--dra-cards``
    dra_nodes: Mapping[str, str] = field(default_factory=dict)
    nodes: dict[str, RealNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(str(self.workdir)) > MAX_WORKDIR:
            raise ClusterError(f"workdir {self.workdir} is too long: unix socket paths under it must stay short")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._started = False
        #: the nodes' addresses, once their block is leased
        self.node_addresses: NodeAddresses | None = None
        self._address_lease: Lease | None = None
        self.launcher = Launcher(self.workdir)
        self.control_plane = ControlPlane(self.launcher, self.rbac, self.audited_users)
        self.schedulers = Schedulers(
            self.launcher,
            self.control_plane.kubeconfigs,
            self.scheduler_names,
            self.plain_schedulers,
            self.policy,
            self.extender_tls,
        )
        self.node_runner = NodeRunner(
            self.launcher, self.control_plane.kubeconfigs, self.nvml_recovery_seconds, self.node_taints, self.dra_nodes
        )

    # --- what clients of the cluster reach -------------------------------------------------------------

    @property
    def api(self) -> Any:
        """The administrator's API client."""
        return self.control_plane.api

    @property
    def admin(self) -> Identity:
        return self.control_plane.admin

    @property
    def server(self) -> str:
        return self.control_plane.server

    @property
    def kubeconfig(self) -> Path:
        """The administrator's kubeconfig (``kubectl --kubeconfig``)."""
        return self.kubeconfig_of(self.admin.user)

    def kubeconfig_of(self, account: str) -> Path:
        return self.control_plane.kubeconfigs.path(account)

    def write_kubeconfig(self, user: str, token: str) -> Path:
        return self.control_plane.kubeconfigs.write(user, token)

    @property
    def audit_log(self) -> Path:
        return self.control_plane.audit_log

    @property
    def controls(self) -> list[Control]:
        return self.schedulers.controls

    @property
    def extender_certs(self) -> Certs | None:
        """The extender's CA and serving certificate, and kube-scheduler's client certificate."""
        return self.schedulers.certs

    @property
    def processes(self) -> list[Process]:
        """Every process started and not yet stopped, in start order."""
        return self.launcher.processes

    # --- start -----------------------------------------------------------------------------------------

    def start(
        self, step: Callable[[str], contextlib.AbstractContextManager[None]] = lambda _what: contextlib.nullcontext()
    ) -> None:
        """Bring everything up; on failure stop what was started and raise :class:`ClusterError`."""
        self._started = True
        try:
            self._make_node_addresses()
            with step("etcd and kube-apiserver"):
                self.control_plane.start([name for name, _ in self.nodes_spec], self.controllers)
            with step(f"{len(self.nodes_spec)} node(s): containerd, gpushare node agent, kubelet"):
                self._start_nodes()
            with step("gpushare extender and kube-scheduler"):
                self.schedulers.start()
        except BaseException:
            self.stop()
            raise

    def start_api_server(self) -> None:
        """Only etcd and kube-apiserver, for clients of the API alone, with kube-controller-manager
        running nothing but what admits pods (each namespace's default ServiceAccount), so no controller
        touches the clients' objects; :meth:`stop` ends them."""
        self._started = True
        try:
            self.control_plane.start([name for name, _ in self.nodes_spec], ("serviceaccount-controller",))
        except BaseException:
            self.stop()
            raise

    def _make_node_addresses(self) -> None:
        """Lease a block of node addresses (refused, naming the clusters that hold them, when none is
        free), remove what a killed cluster that held it last left, and put the nodes' addresses on this
        cluster's link. :meth:`stop` undoes each part that was done."""
        slot, self._address_lease = claim_first_free(
            NODE_BLOCK_LEASE, NODE_BLOCK_COUNT, self.workdir, "blocks of node addresses"
        )
        if (previous := self._address_lease.previous) is not None:
            remove_bridge(node_link(previous))
        self.node_addresses = NodeAddresses(node_link(self.workdir), slot)
        self.node_addresses.create(len(self.nodes_spec))

    def _start_nodes(self) -> None:
        assert self.node_addresses is not None
        image = build_busybox_image(self.workdir / "busybox.tar", (PAUSE_IMAGE, TEST_IMAGE, EXAMPLE_IMAGE))
        for index, (name, gpus) in enumerate(self.nodes_spec):
            bridge = bridge_name(self.workdir, index)
            address = self.node_addresses.address(index)
            node = RealNode(name, gpus, self.workdir / name, bridge, pod_subnet(index), address=address)
            self.nodes[name] = node
            if node.nvml_machine is not None:
                # a node on the NVML driver gives each pod a cgroup, where the driver's memory limits go
                node.cgroup_root = f"/{bridge}-cg"
                node.cgroup_dirs = make_cgroup_root(node.cgroup_root.lstrip("/"))
            node.start_namespace()
            node.start_containerd([image])
            if self.rbac:
                taints = self.node_taints.get(name, ())
                self.node_runner.agent_kubeconfigs[name] = self.control_plane.register_node_agent(name, taints)
            self.node_runner.start_agent(node)
            self.node_runner.start_kubelet(node)
        for node in self.nodes.values():
            self.wait_node_ready(node)

    # --- operations ------------------------------------------------------------------------------------

    def wait_default_service_account(self, namespace: str, timeout: float = 60) -> None:
        """Wait for kube-controller-manager to make ``namespace``'s ``default`` ServiceAccount: until it
        has, the ServiceAccount admission plugin refuses every pod created there."""
        self.control_plane.wait_default_service_account(namespace, timeout)

    def wait_node_ready(self, node: RealNode, timeout: float = 60, reported_after: float = 0.0) -> None:
        """See :meth:`NodeRunner.wait_ready`."""
        self.node_runner.wait_ready(node, self.api, timeout, reported_after)

    def start_kubelet(self, node: RealNode) -> None:
        self.node_runner.start_kubelet(node)

    def stop_kubelet(self, name: str) -> None:
        """Stop the node's kubelet (:meth:`start_kubelet` starts a new one)."""
        self.node_runner.stop_kubelet(self.nodes[name])

    def restart_kubelet(self, name: str) -> None:
        """See :meth:`NodeRunner.restart_kubelet`."""
        self.node_runner.restart_kubelet(self.nodes[name], self.api)

    def restart_agent(self, name: str) -> None:
        self.node_runner.restart_agent(self.nodes[name])

    def container_env(self, node: str, namespace: str, pod: str, container: str) -> dict[str, str]:
        """The environment of a running container's process, read with CRI ExecSync from the node's containerd."""
        return self.nodes[node].container_env(namespace, pod, container)

    def memory_limits(self, node: str, namespace: str, pod: str, container: str) -> str:
        """The GPU memory limits the driver holds the container's pod to, read back through NVML where the
        node's cards enforce them (``card 2 8192 MiB``, or ``none``), else why they don't."""
        cards = self.node_inventory(node).cards
        if not any(card.limits_enforced for card in cards):
            return "not enforced: " + "; ".join(sorted({card.memory_limits for card in cards}))
        real = self.nodes[node]
        env = real.fake_nvml.env() if real.fake_nvml is not None else None
        limits = read_limits(real.pod_cgroup(namespace, pod, container), env)
        return describe_limits(limits, {card.uuid: card.index for card in cards})

    def node_inventory(self, name: str) -> NodeInventory:
        """The cards node ``name``'s advertiser published."""
        from kubernetes import client

        annotations = client.CoreV1Api(self.api).read_node(name).metadata.annotations or {}
        return parse_inventory(annotations.get(NODE_ANN_INVENTORY, ""), name)

    def endpoints(self) -> list[tuple[str, str]]:
        """Where each component answers, one row per component: its name and its URLs."""
        kubectl = binaries.command(binaries.KUBECTL)
        rows = [("kube-apiserver", f"{self.server} ({kubectl} --kubeconfig {self.kubeconfig})")]
        for control in self.controls:
            if control.extender is None:
                rows.append((f"kube-scheduler {control.scheduler_name}", "no extender"))
                continue
            verbs = f"{control.extender_url} (kube-scheduler's calls{', client certificate' if control.tls else ''})"
            health = f"{control.extender_health_url}/metrics, /healthz, /readyz"
            rows.append((f"extender for {control.scheduler_name}", f"{verbs}; {health}"))
        for node in self.nodes.values():
            metrics = f"http://127.0.0.1:{node.agent_metrics_port}/metrics, /healthz, /readyz"
            rows.append((f"node agent {node.name}", metrics))
        return rows

    def all_pids(self) -> list[int]:
        """Every process this cluster runs now, containerd's shims and the containers included."""
        return processes_using(self.workdir)

    # --- stop ------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process: schedulers and extenders, kubelets (so nothing restarts pods), node agents,
        each containerd with its pods and shims, the API server and etcd, then the namespaces; then
        delete the nodes' bridges. Signals wait until it is done: stopped halfway, it would leave the
        rest running."""
        if not self._started:
            return
        with signals_ignored():
            self._stop()
        self._started = False

    def _stop(self) -> None:
        stop_nodes(self.launcher, list(self.nodes.values()), ("kube-scheduler", "extender", "kubelet", "node-agent"))
        self.control_plane.close()
        if self.node_addresses is not None:
            self.node_addresses.remove()
        if self._address_lease is not None:
            self._address_lease.release()


@contextlib.contextmanager
def running_cluster(nodes: Sequence[tuple[str, str]], workdir: Path, **options: Any) -> Iterator[RealCluster]:
    cluster = RealCluster(nodes, workdir, **options)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
