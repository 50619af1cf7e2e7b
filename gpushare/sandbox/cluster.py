"""The stand-in cluster of ``gpushare sandbox``: its processes started and stopped, with simulated cards.

Everything but the cards is real: the API stand-in speaks the Kubernetes REST API, the extender runs in
its own process and is called over HTTP with kube-scheduler's JSON, the device plugins serve kubelet's
gRPC protocol over unix sockets, and, when containerd can run here, each node has its CRI shim in front
of it. :mod:`gpushare.sandbox.standin` runs the pods on it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.advertiser.agent import Advertiser
from gpushare.cards import Card
from gpushare.contract.inventory import parse_inventory
from gpushare.contract.names import (
    NODE_ANN_INVENTORY,
    RESOURCE_COUNT,
    RESOURCE_MEM,
    RESOURCES,
)
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.inspection.render import render_details
from gpushare.inspection.views import build_cluster
from gpushare.kube.events import EventRecorder
from gpushare.kube.nodeapi import NodeApi
from gpushare.kube.objects import list_nodes, list_pods
from gpushare.kube.transport import load_api
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubeletemulator import KubeletEmulator
from gpushare.sandbox.nodespec import NodeSpec
from gpushare.sandbox.printout import Progress
from gpushare.settings import NodeSettings, RewriteOptions, ShimSettings

log = logging.getLogger(__name__)


def devices_listed(kubelet: KubeletEmulator) -> bool:
    """Both resources' first device lists have reached kubelet: before that the node would publish
    ``aliyun.com/gpu-count: 0``, and the original inspect and extender would see no cards."""
    return all(kubelet.updates(r) > 0 for r in RESOURCES) and kubelet.capacity(RESOURCE_MEM) > 0


class SandboxError(RuntimeError):
    """The sandbox could not come up; the message says which part failed."""


class PublishedCards:
    """The cards a node agent in its own process published, read back from its node annotation."""

    def __init__(self, api: Any, node: str) -> None:
        self._api, self._node = api, node

    def cards(self) -> list[Card]:
        from gpushare.kube.objects import get_node

        text = (get_node(self._api, self._node)["metadata"].get("annotations") or {}).get(NODE_ANN_INVENTORY)
        return list(parse_inventory(text, self._node).cards) if text else []


@dataclass
class SimNode:
    spec: NodeSpec
    backend: SimulatedBackend | PublishedCards
    kubelet: KubeletEmulator
    stop: list[Callable[[], None]] = field(default_factory=list)
    cri_address: str | None = None


class Sandbox:
    def __init__(
        self, nodes: Sequence[NodeSpec], policy: str, containers: bool, workdir: Path, nvml_fake: Sequence[str] = ()
    ) -> None:
        self.nodes_spec = list(nodes)
        self.nvml_fake = list(nvml_fake)
        self.policy = policy
        self.want_containers = containers
        self.workdir = workdir
        self.apiserver = ApiServer()
        self.kubeconfig = workdir / "kubeconfig"
        self.api: Any = None
        self.events: EventRecorder | None = None
        self.nodes: dict[str, SimNode] = {}
        self.extender_url = ""
        self.containerd: Any = None
        self.container_note = ""
        self._cleanup: list[Callable[[], None]] = []

    def start(self, progress: Progress) -> None:
        with progress.step("API server stand-in"):
            self.apiserver.start()
            self.apiserver.write_kubeconfig(self.kubeconfig)
            self._cleanup.append(self.apiserver.stop)
            self.api = load_api(str(self.kubeconfig))
            self.events = EventRecorder(self.api, "gpushare-sandbox-scheduler")
            self._cleanup.append(self.events.close)
        with progress.step("containerd for real containers"):
            self._start_containerd()
        count = len(self.nodes_spec) + len(self.nvml_fake)
        with progress.step(f"{count} node(s): advertiser, device plugin, CRI shim, kubelet"):
            for spec in self.nodes_spec:
                self._start_node(spec)
            for machine in self.nvml_fake:
                self._start_nvml_node(machine)
        with progress.step("scheduler extender"):
            self._start_extender()

    def _start_containerd(self) -> None:
        from gpushare.sandbox.containerd import (
            TEST_IMAGE,
            Containerd,
            build_busybox_image,
            containerd_available,
        )

        reason = containerd_available() if self.want_containers else "disabled with --no-containers"
        if reason:
            self.container_note = f"no real containers ({reason}): env shown is what kubelet would pass"
            return
        base = Path(tempfile.mkdtemp(prefix="gs-ctrd", dir="/tmp"))  # unix socket paths must stay short
        daemon = Containerd(base)
        daemon.start()
        self._cleanup.append(daemon.close)
        daemon.import_image(build_busybox_image(base / "busybox.tar"))
        self.containerd = daemon
        self.test_image = TEST_IMAGE
        self.container_note = "env read with ExecSync from the running container process"

    def _start_node(self, spec: NodeSpec) -> None:
        from gpushare.deviceplugin.wiring import start_device_plugin

        self.apiserver_create_node(spec)
        directory = self._node_dir(spec.name[:8])
        backend = SimulatedBackend(spec.name, spec.gpus)
        settings = NodeSettings(spec.name, str(self.kubeconfig), f"sim:{spec.gpus}", directory, GIB, frozenset())
        kubelet = KubeletEmulator(directory)
        # stopped with the sandbox from here on, however far its start gets
        node = self.nodes[spec.name] = SimNode(spec, backend, kubelet)
        advertiser = Advertiser(self.api, spec.name, backend, GIB)
        advertiser.start()
        node.stop.insert(0, advertiser.stop)
        kubelet.start()
        node.stop.insert(0, kubelet.stop)
        shared = NodeApi(self.api, spec.name).start()  # one pod watch for the node, as gpushare node has
        node.stop.insert(0, shared.stop)
        plugin = start_device_plugin(settings, backend, self.api, shared)
        node.stop.insert(0, plugin.stop)
        if not kubelet.wait_for(devices_listed, 10):
            raise SandboxError(f"node {spec.name}: the device plugin did not register with the kubelet emulator")
        self._publish_capacity(spec.name, kubelet)
        if self.containerd is not None:
            from gpushare.crishim.wiring import start_cri_shim

            shim_socket = directory / "cri-shim.sock"
            shim_settings = ShimSettings(
                listen=f"unix://{shim_socket}",
                runtime=self.containerd.address,
                allow_api_fetch=True,
                options=RewriteOptions(),
            )
            shim = start_cri_shim(settings, shim_settings, backend, self.api, shared)
            node.stop.insert(0, shim.stop)
            node.cri_address = f"unix://{shim_socket}"

    def _start_nvml_node(self, machine: str) -> None:
        """``gpushare node --gpus nvml`` in its own process, on the fake libnvidia-ml presenting ``machine``."""
        from gpushare.sandbox import fakenvml

        try:
            fake = fakenvml.prepare(machine, self.workdir)
        except fakenvml.FakeNvmlError as exc:
            raise SandboxError(str(exc)) from None
        spec = NodeSpec(f"nvml-{fake.machine.stem}", "nvml")
        self.apiserver_create_node(spec)
        directory = self._node_dir(spec.name[5:13])
        kubelet = KubeletEmulator(directory)
        kubelet.start()
        node = SimNode(spec, PublishedCards(self.api, spec.name), kubelet, stop=[kubelet.stop])
        self.nodes[spec.name] = node
        command = [sys.executable, "-m", "gpushare.cli", "node", "--node-name", spec.name,
                   "--kubeconfig", str(self.kubeconfig), "--gpus", "nvml", "--device-plugin-dir", str(directory),
                   "--metrics-port", "0"]  # fmt: skip
        if self.containerd is not None:
            node.cri_address = f"unix://{directory / 'cri-shim.sock'}"
            command += ["--enforcement", "cri-shim", "--listen", node.cri_address, "--runtime", self.containerd.address]
        else:
            command.append("--no-cri-shim")
        log_path = self.workdir / f"{spec.name}.log"
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=fake.env())
        node.stop.insert(0, lambda: (proc.terminate(), proc.wait(10)))
        if not kubelet.wait_for(lambda k: k.capacity(RESOURCE_MEM) > 0 and k.capacity(RESOURCE_COUNT) > 0, 30):
            raise SandboxError(f"node {spec.name}: the node agent did not register with kubelet; see {log_path}")
        self._publish_capacity(spec.name, kubelet)

    def _node_dir(self, name: str) -> Path:
        """A node's directory for its sockets, in /tmp (their paths must stay short); removed on stop."""
        directory = Path(tempfile.mkdtemp(prefix=f"gs-{name}-", dir="/tmp"))
        self._cleanup.append(lambda: shutil.rmtree(directory, ignore_errors=True))
        return directory

    def apiserver_create_node(self, spec: NodeSpec) -> None:
        from kubernetes import client

        client.CoreV1Api(self.api).create_node(
            {
                "metadata": {"name": spec.name, "labels": {"gpushare": "true", "kubernetes.io/hostname": spec.name}},
                "status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]},
            }
        )

    def _publish_capacity(self, node: str, kubelet: KubeletEmulator) -> None:
        """What kubelet reports for extended resources: capacity = devices, allocatable = healthy ones."""
        from kubernetes import client

        status = {
            "capacity": {r: str(kubelet.capacity(r)) for r in RESOURCES},
            "allocatable": {r: str(kubelet.allocatable(r)) for r in RESOURCES},
        }
        client.CoreV1Api(self.api).patch_node_status(node, {"status": status})

    def _start_extender(self) -> None:
        """The extender runs as its own process, exactly as deployed."""
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log_file = (self.workdir / "extender.log").open("w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpushare.cli",
                "extender",
                "--port",
                str(port),
                "--kubeconfig",
                str(self.kubeconfig),
                "--policy",
                self.policy,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        self._cleanup.append(lambda: (proc.terminate(), proc.wait(10), log_file.close()))
        self.extender_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while not _ready(f"{self.extender_url}/readyz"):
            if proc.poll() is not None:
                raise SandboxError(f"the extender exited: see {self.workdir / 'extender.log'}")
            if time.monotonic() > deadline:
                raise SandboxError("the extender did not become ready within 20s")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes.values():
            for stop in node.stop:
                with contextlib.suppress(Exception):
                    stop()
        for cleanup in reversed(self._cleanup):
            with contextlib.suppress(Exception):
                cleanup()

    def inspect(self) -> str:
        return render_details(build_cluster(list_nodes(self.api), list_pods(self.api)))


def _ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False
