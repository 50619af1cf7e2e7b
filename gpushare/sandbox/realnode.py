"""A simulated node of the real cluster: a private mount namespace holding its containerd, the gpushare node
agent and a kubelet.

Kubelet hard-wires its device-plugin directory to ``/var/lib/kubelet/device-plugins``, so each simulated
node is a private mount namespace (held open by a sleeping process) with its own directories bound over
that path, over ``/var/log/pods`` and over ``/var/lib/cni``; the node's containerd, node agent and kubelet
all run inside it, as they would on a machine of their own. :class:`RealNode` is the node and its
containerd; :class:`NodeRunner` starts its node agent and kubelet among the cluster's processes.
"""

from __future__ import annotations

import subprocess
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
    RESOURCE_MEM,
)
from gpushare.pb import cri_pb2, cri_pb2_grpc
from gpushare.sandbox import binaries
from gpushare.sandbox.configfiles import Kubeconfigs, render_kubelet_config
from gpushare.sandbox.containerd import PAUSE_IMAGE, Containerd
from gpushare.sandbox.fakenvml import FakeNvml, FakeNvmlError
from gpushare.sandbox.fakenvml import prepare as prepare_fake_nvml
from gpushare.sandbox.launch import ClusterError, Launcher, Process, free_port, http_status, wait_for
from gpushare.sandbox.podnetwork import install_pod_network

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
POD_LOG_DIR = Path("/var/log/pods")
CNI_STATE_DIR = Path("/var/lib/cni")
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
    fake_nvml: FakeNvml | None = None
    holder: subprocess.Popen[bytes] | None = None
    containerd: Containerd | None = None
    agent: Process | None = None
    kubelet: Process | None = None
    agent_metrics_port: int = 0
    kubelet_healthz_port: int = 0

    @property
    def in_namespace(self) -> list[str]:
        """The command prefix that runs a program inside this node's mount namespace."""
        assert self.holder is not None
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--"]

    @property
    def cri_socket(self) -> Path:
        """The CRI shim's socket, which kubelet talks to."""
        return self.base / "cri.sock"

    @property
    def device_plugin_dir(self) -> Path:
        """What this node's kubelet sees as /var/lib/kubelet/device-plugins."""
        return self.base / "device-plugins"

    def agent_ready(self) -> bool:
        return http_status(f"http://127.0.0.1:{self.agent_metrics_port}/readyz") == 200

    @property
    def nvml_machine(self) -> str | None:
        return self.gpus[len(NVML_PREFIX) :] if self.gpus.startswith(NVML_PREFIX) else None

    def start_namespace(self) -> None:
        """A process holding a private mount namespace with the node's own kubelet directories, and its
        own /var/lib/cni, where the CNI library caches each pod's network (nothing of it on the host)."""
        binds = [(self.device_plugin_dir, DEVICE_PLUGIN_DIR), (self.base / "pod-logs", POD_LOG_DIR),
                 (self.base / "cni-state", CNI_STATE_DIR)]  # fmt: skip
        for own, target in binds:
            own.mkdir(parents=True, exist_ok=True)
            target.mkdir(parents=True, exist_ok=True)
        script = " && ".join(f'mount --bind "${2 * i + 1}" "${2 * i + 2}"' for i in range(len(binds)))
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             f"{script} && echo ready && exec sleep 2147483647", "sh", *(str(p) for bind in binds for p in bind)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
            cwd=self.base,
        )  # fmt: skip
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != b"ready":
            self.holder.wait()
            err = self.holder.stderr.read().decode(errors="replace") if self.holder.stderr else ""
            raise ClusterError(f"node {self.name}: could not make its mount namespace: {err.strip()}")

    def end_namespace(self) -> None:
        """End the process holding the mount namespace (its mounts go with it)."""
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait()

    def start_containerd(self, image: Path) -> None:
        """The node's containerd in its namespace, on its pod network, with ``image`` (a docker archive) imported."""
        self.containerd = Containerd(self.base / "ctrd", PAUSE_IMAGE, self.in_namespace)
        install_pod_network(self.containerd.base, self.bridge, self.subnet, self.base / "cni-ipam")
        self.containerd.start()
        self.containerd.import_image(image)

    def container_env(self, namespace: str, pod: str, container: str) -> dict[str, str]:
        """The environment of a running container's process, read with CRI ExecSync from the node's containerd."""
        assert self.containerd is not None
        with grpc.insecure_channel(self.containerd.address) as channel:
            stub = cri_pb2_grpc.RuntimeServiceStub(channel)
            selector = {
                CRI_LABEL_POD_NAME: pod,
                CRI_LABEL_POD_NAMESPACE: namespace,
                CRI_LABEL_CONTAINER_NAME: container,
            }
            found = stub.ListContainers(
                cri_pb2.ListContainersRequest(
                    filter=cri_pb2.ContainerFilter(
                        label_selector=selector, state=cri_pb2.ContainerStateValue(state=cri_pb2.CONTAINER_RUNNING)
                    )
                ),
                timeout=10,
            ).containers
            if not found:
                raise ClusterError(f"no running container {container} of pod {namespace}/{pod} on node {self.name}")
            reply = stub.ExecSync(
                cri_pb2.ExecSyncRequest(container_id=found[0].id, cmd=["env"], timeout=10), timeout=20
            )
        if reply.exit_code != 0:
            raise ClusterError(f"env in {namespace}/{pod}/{container} exited {reply.exit_code}: {reply.stderr!r}")
        return dict(line.split("=", 1) for line in reply.stdout.decode().splitlines() if "=" in line)


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
            env = node.fake_nvml.env()
        node.agent = self.launcher.spawn(
            f"node-agent-{node.name}",
            [
                *node.in_namespace,
                sys.executable, "-m", "gpushare.cli", "node",
                "--node-name", node.name,
                "--kubeconfig", str(self.kubeconfigs.path("gpushare-node-agent")),
                "--gpus", *gpus,
                "--listen", f"unix://{node.cri_socket}",
                "--runtime", node.containerd.address if node.containerd else "",
                "--metrics-port", str(node.agent_metrics_port),
                "--metrics-host", "127.0.0.1",
            ],
            env,
        )  # fmt: skip
        agent = node.agent
        wait_for(lambda: agent.check() or node.cri_socket.exists(), 30, f"node {node.name}: the CRI shim's socket")

    def restart_agent(self, node: RealNode) -> None:
        assert node.agent is not None
        self.launcher.stop(node.agent)
        self.start_agent(node)

    def start_kubelet(self, node: RealNode) -> None:
        port, node.kubelet_healthz_port = free_port(), free_port()
        config = node.base / "kubelet.yaml"
        config.write_text(
            render_kubelet_config(port, node.kubelet_healthz_port, node.cri_socket, self.taints.get(node.name, ()))
        )
        node.kubelet = self.launcher.spawn(
            f"kubelet-{node.name}",
            [
                *node.in_namespace,
                str(binaries.built("kubelet")),
                f"--config={config}",
                f"--kubeconfig={self.kubeconfigs.path(f'system:node:{node.name}')}",
                f"--root-dir={node.base / 'kubelet'}",
                f"--cert-dir={node.base / 'kubelet-pki'}",
                f"--hostname-override={node.name}",
                "--node-ip=127.0.0.1",
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
        """Wait for Ready, gpu-mem on offer and the node agent ready, in a status kubelet reported after
        ``reported_after`` (epoch seconds) when given, and for kube-controller-manager to have lifted
        the node's not-ready taint (until then kube-scheduler places nothing there)."""
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
            return int((status.allocatable or {}).get(RESOURCE_MEM, "0")) > 0 and node.agent_ready()

        what = f"node {node.name} to be Ready and untainted with {RESOURCE_MEM} (logs in {self.launcher.workdir})"
        wait_for(ready, timeout, what, 0.2)
