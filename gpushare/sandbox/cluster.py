"""``gpushare sandbox``: the whole system on one machine, with simulated cards and no cluster.

Everything but the cards is real: the API stand-in speaks the Kubernetes REST API, the extender is
called over HTTP with kube-scheduler's JSON, the device plugins serve kubelet's gRPC protocol over unix
sockets, and, when containerd can run here, every container is created through the node's CRI shim
and its environment is read back from the running process.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from advertiser.agent import Advertiser
from gpushare.cards import Card
from gpushare.contract.inventory import parse_inventory
from gpushare.contract.names import (
    ENV_MEM_CONTAINER,
    ENV_MEM_DEV,
    ENV_MEM_IDX,
    ENV_MEM_POD,
    ENV_VISIBLE_DEVICES,
    NODE_ANN_INVENTORY,
    RESOURCE_COUNT,
    RESOURCE_MEM,
    RESOURCES,
)
from gpushare.contract.request import requests_gpu
from gpushare.contract.units import GIB
from gpushare.inspection.model import build_cluster
from gpushare.inspection.render import render_details, render_table
from gpushare.inventory import SimulatedBackend
from gpushare.kube.events import EventRecorder
from gpushare.kube.objects import bind_pod, get_pod, list_nodes, list_pods, patch_pod_status
from gpushare.kube.transport import load_api
from gpushare.placement import DEFAULT_POLICY
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubelet import AdmissionResult, KubeletEmulator
from gpushare.sandbox.scheduler import ExtenderCallError, ExtenderClient, schedule_one
from gpushare.settings import NodeSettings

log = logging.getLogger(__name__)

DEFAULT_NODES = ("node-a=2xA100-80GB:81920,1xT4:15360", "node-b=1xA100-40GB:40960,2xA10:24576")
EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
GPU_ENV = (ENV_VISIBLE_DEVICES, ENV_MEM_IDX, ENV_MEM_POD, ENV_MEM_CONTAINER, ENV_MEM_DEV)


def devices_listed(kubelet: KubeletEmulator) -> bool:
    """Both resources' first device lists have reached kubelet: before that the node would publish
    ``aliyun.com/gpu-count: 0``, and the original inspect and extender would see no cards."""
    return all(kubelet.updates(r) > 0 for r in RESOURCES) and kubelet.capacity(RESOURCE_MEM) > 0


class SandboxError(RuntimeError):
    """The sandbox could not come up; the message says which part failed."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    gpus: str


def parse_node(text: str) -> NodeSpec:
    name, sep, gpus = text.partition("=")
    if not sep or not name or not gpus:
        raise SandboxError(f"--node {text!r} is not NAME=COUNTxMODEL:MiB[,...]")
    return NodeSpec(name, gpus)


class Progress:
    """One line per start-up step on stderr, with its duration."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self._total = total
        self._done = 0
        self._stream = stream
        self._started = time.monotonic()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self._done += 1
        prefix = f"[{self._done}/{self._total}] {what}"
        self._stream.write(f"{prefix} ...")
        self._stream.flush()
        began = time.monotonic()
        try:
            yield
        except BaseException:
            self._stream.write(" failed\n")
            raise
        self._stream.write(f" done ({time.monotonic() - began:.1f}s)\n")
        self._stream.flush()


@dataclass
class PodOutcome:
    name: str
    node: str = ""
    state: str = "Pending"
    reason: str = ""
    cards: str = ""
    #: container -> its GPU env, and where it was read from
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    env_source: str = ""


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

    # --- start-up ---------------------------------------------------------------------------------------

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
        from deviceplugin.wiring import start_device_plugin

        self.apiserver_create_node(spec)
        directory = Path(tempfile.mkdtemp(prefix=f"gs-{spec.name[:8]}-", dir="/tmp"))
        backend = SimulatedBackend(spec.name, spec.gpus)
        settings = NodeSettings(spec.name, str(self.kubeconfig), f"sim:{spec.gpus}", directory, GIB, frozenset())
        advertiser = Advertiser(self.api, spec.name, backend, GIB)
        advertiser.start()
        kubelet = KubeletEmulator(directory)
        kubelet.start()
        node = SimNode(spec, backend, kubelet)
        node.stop += [kubelet.stop, advertiser.stop]
        plugin = start_device_plugin(settings, backend, self.api)
        node.stop.insert(0, plugin.stop)
        if not kubelet.wait_for(devices_listed, 10):
            raise SandboxError(f"node {spec.name}: the device plugin did not register with the kubelet emulator")
        self._publish_capacity(spec.name, kubelet)
        if self.containerd is not None:
            from crishim.rewrite import RewriteOptions
            from crishim.wiring import ShimSettings, start_cri_shim

            shim_socket = directory / "cri-shim.sock"
            shim_settings = ShimSettings(
                listen=f"unix://{shim_socket}",
                runtime=self.containerd.address,
                allow_api_fetch=True,
                options=RewriteOptions(),
            )
            shim = start_cri_shim(settings, shim_settings, backend, self.api)
            node.stop.insert(0, shim.stop)
            node.cri_address = f"unix://{shim_socket}"
        self.nodes[spec.name] = node

    def _start_nvml_node(self, machine: str) -> None:
        """``gpushare node --gpus nvml`` in its own process, on the fake libnvidia-ml presenting ``machine``."""
        from gpushare.sandbox import fakenvml

        try:
            fake = fakenvml.prepare(machine, self.workdir)
        except fakenvml.FakeNvmlError as exc:
            raise SandboxError(str(exc)) from None
        spec = NodeSpec(f"nvml-{fake.machine.stem}", "nvml")
        self.apiserver_create_node(spec)
        directory = Path(tempfile.mkdtemp(prefix=f"gs-{spec.name[5:13]}-", dir="/tmp"))
        kubelet = KubeletEmulator(directory)
        kubelet.start()
        node = SimNode(spec, PublishedCards(self.api, spec.name), kubelet, stop=[kubelet.stop])
        self.nodes[spec.name] = node
        command = [sys.executable, "-m", "gpushare.cli", "node", "--node-name", spec.name,
                   "--kubeconfig", str(self.kubeconfig), "--gpus", "nvml", "--device-plugin-dir", str(directory),
                   "--metrics-port", "0"]  # fmt: skip
        if self.containerd is not None:
            node.cri_address = f"unix://{directory / 'cri-shim.sock'}"
            command += ["--listen", node.cri_address, "--runtime", self.containerd.address]
        else:
            command.append("--no-cri-shim")
        log_path = self.workdir / f"{spec.name}.log"
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=fake.env())
        node.stop.insert(0, lambda: (proc.terminate(), proc.wait(10)))
        if not kubelet.wait_for(lambda k: k.capacity(RESOURCE_MEM) > 0 and k.capacity(RESOURCE_COUNT) > 0, 30):
            raise SandboxError(f"node {spec.name}: the node agent did not register with kubelet; see {log_path}")
        self._publish_capacity(spec.name, kubelet)

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

    # --- running pods -----------------------------------------------------------------------------------

    def submit(self, manifests: Sequence[Mapping[str, Any]]) -> list[PodOutcome]:
        from kubernetes import client

        core = client.CoreV1Api(self.api)
        outcomes = []
        for manifest in manifests:
            body = with_string_quantities(manifest)
            created = core.create_namespaced_pod(manifest["metadata"].get("namespace", "default"), body)
            outcomes.append(self._run(get_pod(self.api, created.metadata.namespace, created.metadata.name)))
        return outcomes

    def _run(self, pod: dict[str, Any]) -> PodOutcome:
        meta = pod["metadata"]
        outcome = PodOutcome(name=meta["name"])
        node = self._schedule(pod, outcome)
        if node is None:
            return outcome
        outcome.node = node
        pod = get_pod(self.api, meta["namespace"], meta["name"])
        sim = self.nodes[node]
        admission = sim.kubelet.admit(pod)
        if not admission.admitted:
            outcome.state, outcome.reason = "Failed", admission.error
            patch_pod_status(
                self.api,
                meta["namespace"],
                meta["name"],
                {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": admission.error},
            )
            return outcome
        outcome.cards = cards_of(get_pod(self.api, meta["namespace"], meta["name"]), sim.backend.cards())
        self._start_containers(pod, admission, sim, outcome)
        return outcome

    def _schedule(self, pod: dict[str, Any], outcome: PodOutcome) -> str | None:
        node_names = sorted(self.nodes)
        meta = pod["metadata"]
        if not requests_gpu(pod):
            # kube-scheduler calls the extender only for pods that request its managed resources
            node = node_names[0]
            bind_pod(self.api, meta["namespace"], meta["name"], meta.get("uid"), node)
            return node
        try:
            result = schedule_one(ExtenderClient(self.extender_url), pod, node_names)
        except ExtenderCallError as exc:
            outcome.reason = str(exc)
            return None
        if result.node is None:
            outcome.reason = result.reason
            self.events.record(pod, reason="FailedScheduling", message=result.reason, type_="Warning")
            return None
        return result.node

    def _start_containers(
        self, pod: dict[str, Any], admission: AdmissionResult, sim: SimNode, outcome: PodOutcome
    ) -> None:
        from gpushare.sandbox.cri_kubelet import CriRuntime, container_config

        meta = pod["metadata"]
        if sim.cri_address is None:
            for spec in pod["spec"]["containers"]:
                config = container_config(pod, spec, admission.containers.get(spec["name"]), "")
                outcome.env[spec["name"]] = {kv.key: kv.value for kv in config.envs}
            outcome.state, outcome.env_source = "Admitted", "kubelet"
            return
        cri = CriRuntime(sim.cri_address)
        try:
            outcome.env = cri.run_pod(pod, admission.containers, self.test_image)
            outcome.state, outcome.env_source = "Running", "container"
            patch_pod_status(self.api, meta["namespace"], meta["name"], {"phase": "Running"})
        except grpc.RpcError as exc:
            outcome.state, outcome.reason = "CreateContainerError", exc.details() or str(exc.code())
        finally:
            cri.close()

    def stop(self) -> None:
        for node in self.nodes.values():
            for stop in node.stop:
                with contextlib.suppress(Exception):
                    stop()
        for cleanup in reversed(self._cleanup):
            with contextlib.suppress(Exception):
                cleanup()

    # --- reporting -------------------------------------------------------------------------------------

    def inspect(self) -> str:
        return render_details(build_cluster(list_nodes(self.api), list_pods(self.api)))


def with_string_quantities(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Resource quantities as the API serves them (strings); YAML reads ``gpu-mem: 8`` as a number."""
    body = copy.deepcopy(dict(manifest))
    spec = body.get("spec") or {}
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        for field_name in ("limits", "requests"):
            values = (container.get("resources") or {}).get(field_name) or {}
            for key, value in values.items():
                values[key] = str(value)
    return body


def _ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def cards_of(pod: Mapping[str, Any], cards: Iterable[Card]) -> str:
    """The pod's cards per container, for the report."""
    from gpushare.usage import pod_allocation

    allocation = pod_allocation(pod, list(cards)) or {}
    return "; ".join(
        f"{name}: " + ",".join(f"card {s.index} ({s.units} GiB)" for s in slices)
        for name, slices in sorted(allocation.items())
    )


def log_to(path: Path) -> None:
    """Component logs go to a file; the terminal keeps the progress lines, warnings and the report."""
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setLevel(logging.ERROR)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)


def load_examples(directory: Path = EXAMPLES) -> list[dict[str, Any]]:
    manifests = [yaml.safe_load(p.read_text()) for p in sorted(directory.glob("*.yaml"))]
    return [m for m in manifests if m and m.get("kind") == "Pod"]


def render_pods(outcomes: Sequence[PodOutcome]) -> str:
    rows = [["POD", "NODE", "CARDS", "STATE", "REASON"]]
    rows += [[o.name, o.node or "-", o.cards or "-", o.state, o.reason or "-"] for o in outcomes]
    return render_table(rows)


def render_env(outcomes: Sequence[PodOutcome]) -> str:
    rows = [["POD", "CONTAINER", *GPU_ENV]]
    for o in outcomes:
        for container, env in sorted(o.env.items()):
            rows.append([o.name, container, *(_short(env.get(k, "-")) for k in GPU_ENV)])
    return render_table(rows)


def _short(value: str) -> str:
    """Card UUIDs are long; the first block is enough to tell them apart in a table."""
    return ",".join(v[:12] if v.startswith("GPU-") else v for v in value.split(","))


def run(
    nodes: Sequence[str],
    policy: str,
    containers: bool,
    keep_running: bool,
    standin: bool = False,
    out: Any = sys.stdout,
    nvml_fake: Sequence[str] = (),
) -> int:
    """On a real Kubernetes when it can run here (and ``standin`` is off), else on the stand-ins."""
    # with fake-NVML nodes and no --node, the fake-NVML nodes run alone
    specs = [parse_node(n) for n in nodes or (() if nvml_fake else DEFAULT_NODES)]
    if not standin:
        from gpushare.sandbox.realcluster import realcluster_available
        from gpushare.sandbox.realsandbox import run_real

        reason = "--no-containers asks for no containers" if not containers else realcluster_available()
        if reason is None:
            return run_real(specs, policy, keep_running, out, nvml_fake)
        print(f"gpushare sandbox: using the API stand-in and kubelet emulator: {reason}", file=sys.stderr)
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-sandbox-"))
    log_to(workdir / "sandbox.log")
    policy = policy or DEFAULT_POLICY
    sandbox = Sandbox(specs, policy, containers, workdir, nvml_fake)
    progress = Progress(total=5)
    started = time.monotonic()
    try:
        sandbox.start(progress)
        with progress.step(
            f"scheduling and starting the example pods from {EXAMPLES.relative_to(EXAMPLES.parents[1])}"
        ):
            outcomes = sandbox.submit(load_examples())
        report(outcomes, policy, started, sandbox.inspect(), sandbox.container_note, out)
        if keep_running:
            stay_up(
                f"gpushare inspect --kubeconfig {sandbox.kubeconfig}\n         curl {sandbox.extender_url}/metrics", out
            )
    except SandboxError as exc:
        print(f"gpushare sandbox: {exc}", file=sys.stderr)
        return 1
    finally:
        sandbox.stop()
    return 0


def report(outcomes: Sequence[PodOutcome], policy: str, started: float, inspect: str, note: str, out: Any) -> None:
    print(f"\nPods (policy {policy}; {time.monotonic() - started:.1f}s from start)\n", file=out)
    print(render_pods(outcomes), file=out)
    print("\nPer-card allocation (gpushare inspect -d)\n", file=out)
    print(inspect, file=out)
    print(f"\nGPU environment of each container ({note})\n", file=out)
    print(render_env(outcomes), file=out)


def stay_up(hints: str, out: Any) -> None:
    print(f"\nRunning. Try: {hints}\nCtrl-C to stop.", file=out, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)
