"""A simulated node of the real cluster: a private mount namespace holding its containerd, the gpushare node
agent and a kubelet.

Kubelet hard-wires its device-plugin directory to ``/var/lib/kubelet/device-plugins``, so each simulated
node is a private mount namespace (held open by a sleeping process) with its own directories bound over
that path, over ``/var/log/pods`` and over ``/var/lib/cni``; the node's containerd, node agent and kubelet
all run inside it, as they would on a machine of their own. A node with ``host_paths`` goes further, for
gpushare installed as pods whose hostPath volumes name a real host's paths: its own ``/var/lib/kubelet``
(kubelet's configuration in ``config.yaml``, as kubeadm writes it), a private ``/run`` with containerd's
directory at ``/run/containerd``, containerd's NRI socket where containerd 2 puts it by default
(``/var/run/nri/nri.sock``, ``/var/run`` being ``/run``) and room for the CRI shim's ``/run/gpushare``,
and the fake NVML driver library where the NVIDIA GPU operator puts the driver's. :class:`RealNode` is
the node and its containerd; :class:`NodeRunner` starts its node agent and kubelet among the cluster's
processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpushare.contract.names import (
    CRI_LABEL_CONTAINER_NAME,
    CRI_LABEL_POD_NAME,
    CRI_LABEL_POD_NAMESPACE,
    NRI_SOCKET,
    RESOURCE_MEM,
    dra_slice_name,
)
from gpushare.gpus.split import ALL_CARDS
from gpushare.memlimits.cgroups import detect_layout, unified_path
from gpushare.pb import cri_pb2, cri_pb2_grpc
from gpushare.sandbox import binaries
from gpushare.sandbox.certs import kubelet_client_ca
from gpushare.sandbox.configfiles import Kubeconfigs, render_kubelet_config
from gpushare.sandbox.containerd import PAUSE_IMAGE, Containerd
from gpushare.sandbox.fakenvml import FakeNvml, FakeNvmlError
from gpushare.sandbox.fakenvml import prepare as prepare_fake_nvml
from gpushare.sandbox.launch import ClusterError, Launcher, Process, free_port, http_status, processes_using, wait_for
from gpushare.sandbox.mountns import Mount, MountNamespace
from gpushare.sandbox.nodecgroups import remove_cgroup_root
from gpushare.sandbox.podnetwork import install_pod_network, remove_bridge

log = logging.getLogger(__name__)

KUBELET_DIR = Path("/var/lib/kubelet")
DEVICE_PLUGIN_DIR = KUBELET_DIR / "device-plugins"
POD_LOG_DIR = Path("/var/log/pods")
CNI_STATE_DIR = Path("/var/lib/cni")
#: on a node with host paths: where its containerd's socket is, and the CRI shim's directory (the chart's)
CONTAINERD_RUN_DIR, GPUSHARE_RUN_DIR = Path("/run/containerd"), Path("/run/gpushare")
#: where the NVIDIA GPU operator's driver container puts libnvidia-ml.so.1 (docs/operations.md)
OPERATOR_NVML = Path("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
#: a node spec's GPUs starting with this run on the fake libnvidia-ml
NVML_PREFIX = "nvml:"


@dataclass
class RealNode:
    """One simulated node: a mount namespace with its containerd, node agent and kubelet.

    ``gpus`` is ``sim:SPEC``'s SPEC, or ``nvml:MACHINE`` for a node agent running ``--gpus nvml`` on the
    fake libnvidia-ml presenting MACHINE (see :mod:`gpushare.sandbox.fakenvml`; then :attr:`fake_nvml`
    scripts its faults)."""

    name: str
    gpus: str
    base: Path
    #: its pods' bridge and subnet
    bridge: str = ""
    subnet: str = ""
    #: the paths a real host's programs use, private to this node (see the module's docstring)
    host_paths: bool = False
    #: the node's IP: its kubelet's and its host-network pods' (see
    #: :class:`~gpushare.sandbox.podnetwork.NodeAddresses`; kubelet refuses loopback)
    address: str = "127.0.0.1"
    #: with host paths: the fake libnvidia-ml.so.1 (its machine built in) bound at :data:`OPERATOR_NVML`
    nvml_library: Path | None = None
    fake_nvml: FakeNvml | None = None
    #: the node's own cgroup root (``/NAME`` in each hierarchy) when its kubelet gives pods cgroups
    cgroup_root: str = ""
    cgroup_dirs: list[Path] = field(default_factory=list)
    namespace: MountNamespace | None = None
    containerd: Containerd | None = None
    agent: Process | None = None
    kubelet: Process | None = None
    agent_metrics_port: int = 0
    kubelet_healthz_port: int = 0

    @property
    def in_namespace(self) -> list[str]:
        """The command prefix that runs a program inside this node's mount namespace."""
        assert self.namespace is not None
        return self.namespace.prefix

    @property
    def cri_socket(self) -> Path:
        """The CRI shim's socket, which kubelet talks to (on a node with host paths: once told to; it
        lies in the node's private /run, the node agent's pod makes it there)."""
        if self.host_paths:
            assert self.namespace is not None
            return self.namespace.root / GPUSHARE_RUN_DIR.relative_to("/") / "cri.sock"
        return self.base / "cri.sock"

    @property
    def kubelet_dir(self) -> Path:
        """What this node's kubelet sees as /var/lib/kubelet (with host paths, its root directory)."""
        return self.base / "kubelet"

    @property
    def device_plugin_dir(self) -> Path:
        """What this node's kubelet sees as /var/lib/kubelet/device-plugins."""
        return self.kubelet_dir / "device-plugins" if self.host_paths else self.base / "device-plugins"

    def mounts(self) -> list[Mount]:
        """What the node's namespace puts where, in order."""
        shared = [(self.base / "pod-logs", POD_LOG_DIR), (self.base / "cni-state", CNI_STATE_DIR)]
        if not self.host_paths:
            return [(self.device_plugin_dir, DEVICE_PLUGIN_DIR), *shared]
        mounts: list[Mount] = [
            (self.kubelet_dir, KUBELET_DIR), *shared, (None, Path("/run")),
            (self.base / "ctrd", CONTAINERD_RUN_DIR),
        ]  # fmt: skip
        if self.nvml_library is not None:
            mounts.append((self.nvml_library, OPERATOR_NVML))
        return mounts

    def agent_ready(self) -> bool:
        return http_status(f"http://127.0.0.1:{self.agent_metrics_port}/readyz") == 200

    @property
    def nvml_machine(self) -> str | None:
        return self.gpus[len(NVML_PREFIX) :] if self.gpus.startswith(NVML_PREFIX) else None

    def start_namespace(self) -> None:
        """The node's mount namespace (:meth:`mounts`), where its containerd, node agent and kubelet run."""
        self.namespace = MountNamespace(f"node {self.name}", self.base, self.mounts())
        self.namespace.start()

    def end_namespace(self) -> None:
        """End the node's mount namespace (its mounts go with it)."""
        if self.namespace is not None:
            self.namespace.end()

    def start_containerd(self, images: Sequence[Path], routes: Sequence[str] = ()) -> None:
        """The node's containerd in its namespace, on its pod network (routed to ``routes``: see
        :func:`~gpushare.sandbox.podnetwork.render_pod_network`), with ``images`` (archives) imported.
        A node with host paths runs images the size of gpushare's, unpacked for overlayfs, and takes NRI
        plugins on ``/var/run/nri/nri.sock`` in its own ``/run``: where containerd 2 puts the socket
        unconfigured (its internal/nri/config.go takes NRI's DefaultSocketPath, NRI on by default since 2.0),
        so the node comes as a provider's does."""
        snapshotter = "overlayfs" if self.host_paths else "native"
        self.containerd = Containerd(
            self.base / "ctrd", PAUSE_IMAGE, self.in_namespace, snapshotter, private_cdi=not self.host_paths,
            nri_socket=Path(NRI_SOCKET) if self.host_paths else None,
        )  # fmt: skip
        install_pod_network(self.containerd.base, self.bridge, self.subnet, self.base / "cni-ipam", routes)
        self.containerd.start()
        for image in images:
            self.containerd.import_image(image)

    def _running_container(self, stub: Any, namespace: str, pod: str, container: str) -> str:
        selector = {CRI_LABEL_POD_NAME: pod, CRI_LABEL_POD_NAMESPACE: namespace, CRI_LABEL_CONTAINER_NAME: container}
        running = cri_pb2.ContainerStateValue(state=cri_pb2.CONTAINER_RUNNING)
        request = cri_pb2.ListContainersRequest(filter=cri_pb2.ContainerFilter(label_selector=selector, state=running))
        found = stub.ListContainers(request, timeout=10).containers
        if not found:
            raise ClusterError(f"no running container {container} of pod {namespace}/{pod} on node {self.name}")
        return str(found[0].id)

    def container_env(self, namespace: str, pod: str, container: str) -> dict[str, str]:
        """The environment of a running container's process, read with CRI ExecSync from the node's containerd."""
        assert self.containerd is not None
        with grpc.insecure_channel(self.containerd.address) as channel:
            stub = cri_pb2_grpc.RuntimeServiceStub(channel)
            found = self._running_container(stub, namespace, pod, container)
            reply = stub.ExecSync(cri_pb2.ExecSyncRequest(container_id=found, cmd=["env"], timeout=10), timeout=20)
        if reply.exit_code != 0:
            raise ClusterError(f"env in {namespace}/{pod}/{container} exited {reply.exit_code}: {reply.stderr!r}")
        return dict(line.split("=", 1) for line in reply.stdout.decode().splitlines() if "=" in line)

    def pod_cgroup(self, namespace: str, pod: str, container: str) -> Path:
        """The cgroup v2 directory of the pod a running container belongs to: the parent of the
        container's own cgroup."""
        return self.container_cgroup(namespace, pod, container).parent

    def container_cgroup(self, namespace: str, pod: str, container: str) -> Path:
        """The cgroup v2 directory of a running container, as the kernel says its process is in it."""
        pid = self.container_pid(namespace, pod, container)
        path = unified_path(Path(f"/proc/{pid}/cgroup").read_text())
        unified = detect_layout(Path("/proc/self/mountinfo").read_text()).unified
        if path is None or unified is None:
            raise ClusterError(f"pod {namespace}/{pod} on node {self.name}: its process {pid} is in no cgroup v2")
        return unified / path.lstrip("/")

    def container_pid(self, namespace: str, pod: str, container: str) -> int:
        """The host PID of a running container's process, from containerd's verbose container status."""
        assert self.containerd is not None
        with grpc.insecure_channel(self.containerd.address) as channel:
            stub = cri_pb2_grpc.RuntimeServiceStub(channel)
            found = self._running_container(stub, namespace, pod, container)
            request = cri_pb2.ContainerStatusRequest(container_id=found, verbose=True)
            info = stub.ContainerStatus(request, timeout=10).info.get("info", "{}")
        return int(json.loads(info)["pid"])


@dataclass
class NodeRunner:
    """Starts a node's gpushare node agent and kubelet in its namespace, as its DaemonSet pod and its
    machine would, among the cluster's processes (``launcher``), and waits for the node to be Ready."""

    launcher: Launcher
    kubeconfigs: Kubeconfigs
    #: ``--nvml-recovery-seconds`` of the fake-NVML nodes' agents
    nvml_recovery_seconds: float = 300.0
    #: per node name, taints its kubelet registers with (``key=value:Effect``)
    taints: Mapping[str, Sequence[str]] = field(default_factory=dict)
    #: per node whose agent also serves the DRA driver (``--dra``), its ``--dra-cards``
    dra_nodes: Mapping[str, str] = field(default_factory=dict)
    #: per node, its agent's kubeconfig where it has one of its own (a token bound to its Node); the
    #: others use the node agent's shared one
    agent_kubeconfigs: dict[str, Path] = field(default_factory=dict)

    def start_agent(self, node: RealNode) -> None:
        """``gpushare node`` in the node's namespace, as its DaemonSet pod would run it."""
        node.agent_metrics_port = free_port()
        gpus, env = [f"sim:{node.gpus}"], None
        if (machine := node.nvml_machine) is not None:
            if node.fake_nvml is None:
                try:
                    node.fake_nvml = prepare_fake_nvml(machine, node.base)
                except FakeNvmlError as exc:
                    raise ClusterError(f"node {node.name}: {exc}") from None
            gpus = ["nvml", "--nvml-recovery-seconds", f"{self.nvml_recovery_seconds:g}"]
            layout = detect_layout(Path("/proc/self/mountinfo").read_text())
            if node.cgroup_root and layout.unified is not None:
                # these machines are hybrid: the driver's limits go to the cgroup2 mount beside v1
                gpus += ["--cgroup-root", str(layout.unified)]
            env = node.fake_nvml.env()
        node.agent = self.launcher.spawn(
            f"node-agent-{node.name}",
            [
                *node.in_namespace,
                sys.executable, "-m", "gpushare.cli", "node",
                "--node-name", node.name,
                "--kubeconfig", str(self.agent_kubeconfig(node.name)),
                "--gpus", *gpus,
                "--enforcement", "cri-shim",
                "--listen", f"unix://{node.cri_socket}",
                "--runtime", node.containerd.address if node.containerd else "",
                "--metrics-port", str(node.agent_metrics_port),
                "--metrics-host", "127.0.0.1",
                *(["--dra", "--dra-cards", self.dra_nodes[node.name], "--kubelet-root", str(node.kubelet_dir),
                   "--cdi-dir", str(node.base / "ctrd" / "cdi")] if node.name in self.dra_nodes else []),
            ],
            env,
        )  # fmt: skip
        agent = node.agent
        wait_for(lambda: agent.check() or node.cri_socket.exists(), 30, f"node {node.name}: the CRI shim's socket")

    def agent_kubeconfig(self, node: str) -> Path:
        return self.agent_kubeconfigs.get(node) or self.kubeconfigs.path("gpushare-node-agent")

    def restart_agent(self, node: RealNode) -> None:
        assert node.agent is not None
        self.launcher.stop(node.agent)
        self.start_agent(node)

    def start_kubelet(self, node: RealNode) -> None:
        """The node's kubelet, at the node's address. Without host paths it talks to the CRI
        shim; with them its configuration is /var/lib/kubelet/config.yaml, written here the first time
        only (an operator edits it later) with containerd's socket as the runtime, as kubeadm sets a
        node up, and it keeps its state in /var/lib/kubelet."""
        flexvolume, taints = node.base / "flexvolume", self.taints.get(node.name, ())
        client_ca = kubelet_client_ca(self.launcher.workdir)
        if node.host_paths:
            config = node.kubelet_dir / "config.yaml"
            if not config.exists():
                node.kubelet_healthz_port = free_port()
                runtime = CONTAINERD_RUN_DIR / "containerd.sock"
                rendered = render_kubelet_config(
                    free_port(), node.kubelet_healthz_port, runtime, flexvolume, taints, node.address,
                    client_ca=client_ca,
                )  # fmt: skip
                config.write_text(rendered)
            dirs = [f"--config={KUBELET_DIR / 'config.yaml'}"]
        else:
            port, node.kubelet_healthz_port = free_port(), free_port()
            config = node.base / "kubelet.yaml"
            rendered = render_kubelet_config(
                port, node.kubelet_healthz_port, node.cri_socket, flexvolume, taints, node.address,
                cgroup_root=node.cgroup_root, client_ca=client_ca,
            )  # fmt: skip
            config.write_text(rendered)
            dirs = [f"--config={config}", f"--root-dir={node.kubelet_dir}", f"--cert-dir={node.base / 'kubelet-pki'}"]
        node.kubelet = self.launcher.spawn(
            f"kubelet-{node.name}",
            [
                *node.in_namespace,
                str(binaries.built("kubelet")),
                *dirs,
                f"--kubeconfig={self.kubeconfigs.path(f'system:node:{node.name}')}",
                f"--hostname-override={node.name}",
                f"--node-ip={node.address}",
                "--v=2",
            ],
        )

    def stop_kubelet(self, node: RealNode) -> None:
        assert node.kubelet is not None
        self.launcher.stop(node.kubelet)

    def restart_kubelet(self, node: RealNode, api: Any) -> None:
        """Restart the node's kubelet and return once the device plugin has registered with the new one
        and kubelet has reported its resources since. Until then kubelet refuses GPU pods for want of
        devices, as any kubelet does after a restart."""
        self.stop_kubelet(node)
        restarted = time.time()
        self.start_kubelet(node)
        kubelet = node.kubelet
        assert kubelet is not None

        def plugin_serves_again() -> bool:
            """kubelet recreated its socket and wiped the plugin's; the plugin's are back, newer than kubelet's."""
            kubelet.check()
            try:
                kubelet_made = (node.device_plugin_dir / "kubelet.sock").stat().st_ctime
                plugins = [p.stat().st_ctime for p in node.device_plugin_dir.glob("*.sock") if p.name != "kubelet.sock"]
            except FileNotFoundError:
                return False
            return kubelet_made >= restarted and bool(plugins) and min(plugins) >= kubelet_made

        wait_for(plugin_serves_again, 30, f"node {node.name}: the device plugin to serve the restarted kubelet")
        # heartbeats are stamped to the second
        self.wait_ready(node, api, reported_after=time.time() + 1)

    def wait_ready(self, node: RealNode, api: Any, timeout: float = 60, reported_after: float = 0.0) -> None:
        """Wait for Ready in a status kubelet reported after ``reported_after`` (epoch seconds) when given,
        and for kube-controller-manager to have lifted the node's not-ready taint (until then
        kube-scheduler places nothing there); where this runner started the node's agent, also for it
        to be ready and gpu-mem on offer, or its ResourceSlice where every card is DRA's (a node that gets
        gpushare installed later has neither yet)."""
        from kubernetes import client

        core = client.CoreV1Api(api)

        def ready() -> bool:
            for proc in (node.kubelet, node.agent):
                if proc is not None:
                    proc.check()
            try:
                current = core.read_node(node.name)
            except client.ApiException:
                return False
            status = current.status
            ready = next((cond for cond in status.conditions or [] if cond.type == "Ready"), None)
            if ready is None or ready.status != "True" or ready.last_heartbeat_time.timestamp() < reported_after:
                return False
            if any(taint.key == NOT_READY_TAINT for taint in current.spec.taints or []):
                return False
            if node.agent is None:
                return True
            if dra_only and not has_slice():
                return False
            return (dra_only or int((status.allocatable or {}).get(RESOURCE_MEM, "0")) > 0) and node.agent_ready()

        def has_slice() -> bool:
            try:
                client.ResourceV1Api(api).read_resource_slice(dra_slice_name(node.name))
            except client.ApiException:
                return False
            return True

        dra_only = self.dra_nodes.get(node.name) == ALL_CARDS
        offer = f" with {'its ResourceSlice' if dra_only else RESOURCE_MEM}" if node.agent is not None else ""
        what = f"node {node.name} to be Ready and untainted{offer} (logs in {self.launcher.workdir})"
        wait_for(ready, timeout, what, 0.2)


def stop_nodes(launcher: Launcher, nodes: Sequence[RealNode], first: Sequence[str]) -> None:
    """Stop every process of a cluster: those whose names start with ``first``'s prefixes, in that order
    (kubelets before node agents, so nothing restarts pods), then each node's containerd with its pods
    and shims, then the rest in reverse start order; then end the nodes' namespaces, kill whatever still
    runs under the cluster's directory and delete the nodes' bridges."""
    processes = launcher.processes
    for prefix in first:
        for proc in [p for p in processes if p.name.startswith(prefix)]:
            with contextlib.suppress(Exception):
                proc.stop()
    for node in nodes:
        if node.containerd is not None:
            with contextlib.suppress(Exception):
                node.containerd.close()
    for proc in reversed(processes):
        with contextlib.suppress(Exception):
            proc.stop()
    for node in nodes:
        node.end_namespace()
    for pid in processes_using(launcher.workdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        wait_for(lambda: not processes_using(launcher.workdir), 10, f"the processes under {launcher.workdir} to end")
    except ClusterError as exc:
        log.warning("%s", exc)
    for node in nodes:
        remove_bridge(node.bridge)
        remove_cgroup_root(node.cgroup_dirs)
