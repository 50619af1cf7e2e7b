"""A real Kubernetes cluster on this machine, at the version ``build_kube.sh`` pins: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler with the gpushare extender, and per simulated node a private
containerd, the gpushare node agent (simulated cards, CRI shim in front of containerd) and a kubelet.

Kubelet hard-wires its device-plugin directory to ``/var/lib/kubelet/device-plugins``, so each simulated
node is a private mount namespace (held open by a sleeping process) with its own directories bound over
that path, over ``/var/log/pods`` and over ``/var/lib/cni``; the node's containerd, node agent and kubelet
all run inside it, as they would on a machine of their own. The nodes share the host's network
namespace; each node's pods get a bridge and a private subnet of its own (:func:`render_pod_network`),
deleted on stop. Every port is a free one on 127.0.0.1.

The config renderers are pure functions; :class:`RealCluster` starts and stops the processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.names import (
    CRI_LABEL_CONTAINER_NAME,
    CRI_LABEL_POD_NAME,
    CRI_LABEL_POD_NAMESPACE,
    NODE_ANN_INVENTORY,
    RESOURCE_MEM,
)
from gpushare.pb import cri_pb2, cri_pb2_grpc
from gpushare.process import signals_ignored
from gpushare.sandbox import binaries
from gpushare.sandbox.binaries import KUBE_BINARIES
from gpushare.sandbox.certs import Certs, make_certs
from gpushare.sandbox.containerd import (
    PAUSE_IMAGE,
    TEST_IMAGE,
    Containerd,
    build_busybox_image,
    containerd_available,
    log_tail,
)
from gpushare.sandbox.fakenvml import FakeNvml, FakeNvmlError
from gpushare.sandbox.fakenvml import prepare as prepare_fake_nvml

log = logging.getLogger(__name__)

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
POD_LOG_DIR = Path("/var/log/pods")
CNI_STATE_DIR = Path("/var/lib/cni")
CNI_PLUGINS = Path("/usr/lib/cni")
#: the CNI plugins a node's pod network uses (containerd adds each pod's loopback itself)
CNI_PLUGIN_NAMES = ("bridge", "host-local", "loopback")
#: the bridges' names are this, a token of the cluster and the node's index (Linux allows 15 bytes)
BRIDGE_PREFIX = "gs"
REPO = Path(__file__).resolve().parents[2]
SCHEDULER_CONFIG = REPO / "deploy" / "scheduler-config.yaml"
RBAC_MANIFESTS = (REPO / "deploy" / "namespace.yaml", REPO / "deploy" / "rbac.yaml")
#: the image name the pods in deploy/examples use
EXAMPLE_IMAGE = "docker.io/library/busybox:1.36"
SYSTEM_NAMESPACE = "gpushare-system"
#: containerd's socket sits three levels below the workdir, and unix socket paths end at 107 bytes
MAX_WORKDIR = 60
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
#: a node spec's GPUs starting with this run on the fake libnvidia-ml
NVML_PREFIX = "nvml:"
#: the server name kube-scheduler checks the extender's certificate against without a shipped one
EXTENDER_SERVER_NAME = "gpushare-extender.gpushare-system.svc"


class ClusterError(RuntimeError):
    """The cluster could not come up; the message names the part and its log."""


def realcluster_available() -> str | None:
    """None when a real cluster can run here, else why not (a reason to skip or fall back)."""
    if reason := (
        containerd_available()
        or binaries.missing((*KUBE_BINARIES, "etcd"))
        or binaries.host_tool_missing(("unshare", "nsenter", "mount", "openssl", "ip"))
    ):
        return reason
    for plugin in CNI_PLUGIN_NAMES:
        if not (CNI_PLUGINS / plugin).is_file():
            return f"{CNI_PLUGINS / plugin} is missing (apt-get install -y containernetworking-plugins)"
    return None


# --- configuration (pure) ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Identity:
    """A static-token user of the API server."""

    user: str
    token: str
    groups: tuple[str, ...] = ()


def render_token_file(identities: Sequence[Identity]) -> str:
    """kube-apiserver's ``--token-auth-file``: ``token,user,uid,"group1,group2"`` per line."""
    lines = []
    for i, who in enumerate(identities):
        groups = f',"{",".join(who.groups)}"' if who.groups else ""
        lines.append(f"{who.token},{who.user},uid-{i}{groups}")
    return "\n".join(lines) + "\n"


def render_kubeconfig(server: str, user: str, token: str, ca_file: Path) -> str:
    """A kubeconfig for one identity, trusting ``ca_file`` for the server's certificate."""
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "gpushare", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "gpushare", "context": {"cluster": "gpushare", "user": user}}],
            "current-context": "gpushare",
        },
        sort_keys=False,
    )


def render_scheduler_config(
    kubeconfig: Path,
    extender_url: str,
    scheduler_name: str,
    template: Mapping[str, Any],
    tls: SchedulerTls | None = None,
    client_rate: tuple[float, int] | None = None,
) -> str:
    """``deploy/scheduler-config.yaml`` as shipped (``kubescheduler.config.k8s.io/v1``), with only what
    differs on this machine put in: the kubeconfig, one profile named ``scheduler_name``, no leader
    election, and each extender's URL and the files of its ``tlsConfig`` (``tls``; without TLS when
    None). ``client_rate`` sets ``clientConnection``'s ``qps`` and ``burst``."""
    extenders = [_extender_entry(e, extender_url, tls) for e in template.get("extenders") or []]
    if not extenders:
        raise ClusterError(f"{SCHEDULER_CONFIG} has no extenders block")
    config = dict(template)
    config["clientConnection"] = {**(template.get("clientConnection") or {}), "kubeconfig": str(kubeconfig)}
    if client_rate is not None:
        config["clientConnection"].update(qps=client_rate[0], burst=client_rate[1])
    config["leaderElection"] = {"leaderElect": False}
    config["profiles"] = [{"schedulerName": scheduler_name}]
    config["extenders"] = extenders
    return yaml.safe_dump(config, sort_keys=False)


@dataclass(frozen=True, slots=True)
class SchedulerTls:
    """kube-scheduler's side of its TLS connection to the extender: its client certificate and key, and
    the CA that signed the extender's serving certificate."""

    cert_file: str
    key_file: str
    ca_file: str


def _extender_entry(template: Mapping[str, Any], url: str, tls: SchedulerTls | None) -> dict[str, Any]:
    entry = {k: v for k, v in template.items() if k != "tlsConfig"}
    entry["urlPrefix"] = url
    entry["enableHTTPS"] = tls is not None
    if tls is not None:
        shipped = template.get("tlsConfig") or {}
        missing = [k for k in ("certFile", "keyFile", "caFile", "serverName") if k not in shipped]
        if missing:
            raise ClusterError(f"{SCHEDULER_CONFIG}: the extender's tlsConfig lacks {', '.join(missing)}")
        entry["tlsConfig"] = {**shipped, "certFile": tls.cert_file, "keyFile": tls.key_file, "caFile": tls.ca_file}
    return entry


def render_kubelet_config(port: int, healthz_port: int, runtime_socket: Path, taints: Sequence[str] = ()) -> str:
    """Kubelet settings for a node that shares its machine with other simulated nodes: loopback only,
    no QoS cgroups or node-allocatable enforcement (they would be shared), no evictions. The runtime is
    ``runtime_socket`` (the CRI shim's); ``taints`` (``key=value:Effect``) are registered with the node.
    These machines run cgroup v1, which kubelet refuses from 1.35 on unless told otherwise."""
    return yaml.safe_dump(
        {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{runtime_socket}",
            "failCgroupV1": False,
            "volumePluginDir": str(runtime_socket.parent / "flexvolume"),
            "registerWithTaints": [_taint(t) for t in taints],
            "address": "127.0.0.1",
            "port": port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz_port,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "serializeImagePulls": False,
        },
        sort_keys=False,
    )


def _taint(spec: str) -> dict[str, str]:
    """``key=value:Effect`` (or ``key:Effect``) as a Taint object."""
    key_value, _, effect = spec.rpartition(":")
    key, _, value = key_value.partition("=")
    if not key or not effect:
        raise ClusterError(f"taint {spec!r}: expected key=value:Effect")
    return {"key": key, "value": value, "effect": effect} if value else {"key": key, "effect": effect}


def pod_subnet(index: int) -> str:
    """The pod subnet of the cluster's ``index``-th node: private, and distinct per node."""
    return f"10.244.{index}.0/24"


def bridge_name(workdir: Path, index: int) -> str:
    """The bridge of the cluster's ``index``-th node. The nodes, and any other cluster on this machine,
    share the host's network namespace, so the name carries a token of the cluster's directory."""
    token = hashlib.sha256(str(workdir).encode()).hexdigest()[:6]
    return f"{BRIDGE_PREFIX}{token}n{index}"


def render_pod_network(bridge: str, subnet: str, ipam_dir: Path) -> str:
    """A node's pod network (CNI): each pod gets an address in ``subnet`` on the node's own ``bridge``.
    The bridge has no address on the host and the pods no default route, so a pod reaches the other
    pods of its node and nothing beyond; nothing is masqueraded, so no iptables rule is made, and
    host-local keeps its leases in ``ipam_dir``."""
    ipam = {"type": "host-local", "ranges": [[{"subnet": subnet}]], "dataDir": str(ipam_dir)}
    plugin = {"type": "bridge", "bridge": bridge, "isGateway": False, "ipMasq": False, "ipam": ipam}
    return json.dumps({"cniVersion": "0.4.0", "name": "gpushare-pods", "plugins": [plugin]})


def remove_bridge(bridge: str) -> None:
    """Delete the bridge and any pod's veth still attached to it (deleting one end deletes the pair);
    nothing happens when it was never made (no pod of the node needed it)."""
    device = Path("/sys/class/net") / bridge
    if not bridge or not device.exists():
        return
    for port in sorted((device / "brif").glob("*")):
        subprocess.run(["ip", "link", "delete", port.name], capture_output=True, check=False)
    done = subprocess.run(["ip", "link", "delete", bridge], capture_output=True, text=True, check=False)
    if done.returncode != 0 and device.exists():
        log.warning("could not delete bridge %s: %s", bridge, done.stderr.strip())


def as_sandbox_pod(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A pod manifest as the sandbox applies it: deletion needs no grace period, and quantities become
    strings as the API serves them."""
    from gpushare.sandbox.examples import with_string_quantities

    body = with_string_quantities(manifest)
    body.setdefault("spec", {})["terminationGracePeriodSeconds"] = 0
    return body


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll until ``predicate`` returns something truthy; :class:`ClusterError` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# --- processes -----------------------------------------------------------------------------------------


class Process:
    """One child in its own session, logging to a file; stopped with SIGTERM then SIGKILL to its group."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> None:
        """``log_path``'s directory is also the working directory; ``env`` replaces the inherited environment."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with self.log_path.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.log_path.parent,
                env=self.env,
            )
        log.info("started %s (pid %d), log %s", self.name, self.popen.pid, self.log_path)
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else 0

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def check(self) -> None:
        """:class:`ClusterError` with the log's tail if the process has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            raise ClusterError(
                f"{self.name} exited with {self.popen.returncode}; {self.log_path}:\n{log_tail(self.log_path, 15)}"
            )

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        log.info("stopped %s (pid %d)", self.name, self.popen.pid)


def scheduler_argv(config: Path, port: int, open_paths: Sequence[str] = ()) -> list[str]:
    """kube-scheduler reading ``config``, serving /healthz and /metrics on 127.0.0.1:``port`` over HTTPS
    (its only listener since 1.23; /healthz needs no credentials, nor do ``open_paths``)."""
    argv = [
        str(binaries.built("kube-scheduler")),
        f"--config={config}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--v=2",
    ]
    if open_paths:
        argv.append(f"--authorization-always-allow-paths={','.join(('/healthz', '/readyz', '/livez', *open_paths))}")
    return argv


def loopback_get(url: str, token: str = "", timeout: float = 1.0) -> Any:
    """The open reply to a GET of a component on loopback, with ``token`` as its bearer token when
    given; certificates are not checked (loopback, self-signed)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    return urllib.request.urlopen(request, timeout=timeout, context=context)


def _get(url: str, token: str = "", timeout: float = 1.0) -> int:
    """HTTP(S) status of a GET (:func:`loopback_get`), 0 when nothing answers."""
    try:
        with loopback_get(url, token, timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


# --- the cluster ---------------------------------------------------------------------------------------


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
        return _get(f"http://127.0.0.1:{self.agent_metrics_port}/readyz") == 200

    @property
    def nvml_machine(self) -> str | None:
        return self.gpus[len(NVML_PREFIX) :] if self.gpus.startswith(NVML_PREFIX) else None


@dataclass
class Control:
    """Which scheduler profile is served by which kube-scheduler process and extender replica."""

    scheduler_name: str
    extender_port: int
    extender: Process | None = None
    scheduler: Process | None = None
    healthz_port: int = 0
    #: the extender serves its verbs over TLS with a required client certificate; health on its own port
    tls: bool = False
    extender_health_port: int = 0

    @property
    def extender_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.extender_port}"

    @property
    def extender_health_url(self) -> str:
        return f"http://127.0.0.1:{self.extender_health_port}" if self.tls else self.extender_url

    def ready(self) -> bool:
        """Both answer their health checks; :class:`ClusterError` if either has exited."""
        for proc in (self.extender, self.scheduler):
            if proc is not None:
                proc.check()
        return (
            _get(f"{self.extender_health_url}/readyz") == 200
            and _get(f"https://127.0.0.1:{self.healthz_port}/healthz") == 200
        )


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
    nodes: dict[str, RealNode] = field(default_factory=dict)
    controls: list[Control] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)
    api: Any = None

    def __post_init__(self) -> None:
        if len(str(self.workdir)) > MAX_WORKDIR:
            raise ClusterError(f"workdir {self.workdir} is too long: unix socket paths under it must stay short")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_port = free_port()
        self.admin = Identity("gpushare-admin", os.urandom(16).hex(), ("system:masters",))
        self._started = False
        #: the extender's CA and serving certificate, and kube-scheduler's client certificate
        self.extender_certs: Certs | None = None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        """The administrator's kubeconfig (``kubectl --kubeconfig``)."""
        return self.kubeconfig_of(self.admin.user)

    def _path(self, name: str) -> Path:
        return self.workdir / name

    def _spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Process:
        proc = Process(name, argv, self._path(f"{name}.log"), env).start()
        self.processes.append(proc)
        return proc

    # --- start -----------------------------------------------------------------------------------------

    def start(
        self, step: Callable[[str], contextlib.AbstractContextManager[None]] = lambda _what: contextlib.nullcontext()
    ) -> None:
        """Bring everything up; on failure stop what was started and raise :class:`ClusterError`."""
        self._started = True
        try:
            with step("etcd and kube-apiserver"):
                self._start_control_plane(self.controllers)
            with step(f"{len(self.nodes_spec)} node(s): containerd, gpushare node agent, kubelet"):
                self._start_nodes()
            with step("gpushare extender and kube-scheduler"):
                self._start_schedulers()
        except BaseException:
            self.stop()
            raise

    def start_api_server(self) -> None:
        """Only etcd and kube-apiserver, for clients of the API alone, with kube-controller-manager
        running nothing but what admits pods (each namespace's default ServiceAccount), so no controller
        touches the clients' objects; :meth:`stop` ends them."""
        self._started = True
        try:
            self._start_control_plane(controllers=("serviceaccount-controller",))
        except BaseException:
            self.stop()
            raise

    def _start_control_plane(self, controllers: Sequence[str]) -> None:
        from gpushare.kube.transport import load_api

        etcd_port, peer_port = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                str(binaries.built("etcd")),
                "--data-dir", str(self._path("etcd")),
                "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
            ],
        )  # fmt: skip
        sa_key = self._path("sa.key")
        subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
        self.identities = [
            self.admin,
            Identity("system:kube-scheduler", os.urandom(16).hex()),
            Identity("system:kube-controller-manager", os.urandom(16).hex()),
            *(Identity(f"system:node:{n}", os.urandom(16).hex(), ("system:nodes", "system:masters"))
              for n, _ in self.nodes_spec),
        ]  # fmt: skip
        if not self.rbac:
            # without RBAC the gpushare components are ordinary users; with it they use service accounts
            self.identities += [Identity("gpushare-node-agent", os.urandom(16).hex()),
                                Identity("gpushare-extender", os.urandom(16).hex())]  # fmt: skip
        self._path("tokens.csv").write_text(render_token_file(self.identities))
        self.apiserver = self._spawn(
            "kube-apiserver",
            [
                str(binaries.built("kube-apiserver")),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--cert-dir={self._path('apiserver-certs')}",
                f"--token-auth-file={self._path('tokens.csv')}",
                f"--authorization-mode={'RBAC' if self.rbac else 'AlwaysAllow'}",
                f"--service-account-key-file={sa_key}",
                f"--service-account-signing-key-file={sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                *self._audit_flags(),
            ],
        )

        def ready() -> bool:
            self.apiserver.check()
            return _get(f"{self.server}/readyz", self.admin.token) == 200

        wait_for(ready, 60, f"kube-apiserver to answer /readyz (log {self.apiserver.log_path})", 0.2)
        for who in self.identities:
            self.write_kubeconfig(who.user, who.token)
        self.api = load_api(str(self.kubeconfig))
        self._start_controller_manager(sa_key, controllers)
        if self.rbac:
            self._apply_rbac()

    @property
    def audit_log(self) -> Path:
        return self._path("audit.log")

    def _audit_flags(self) -> list[str]:
        if not self.audited_users:
            return []
        policy = {
            "apiVersion": "audit.k8s.io/v1",
            "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "users": list(self.audited_users)}, {"level": "None"}],
        }
        self._path("audit-policy.yaml").write_text(json.dumps(policy))
        return [f"--audit-policy-file={self._path('audit-policy.yaml')}", f"--audit-log-path={self.audit_log}"]

    def _start_controller_manager(self, sa_key: Path, controllers: Sequence[str]) -> None:
        """kube-controller-manager with its default controllers, as on any cluster: it lifts a node's
        not-ready taint once the node is Ready, makes each namespace's ``default`` ServiceAccount and
        publishes ``kube-root-ca.crt`` (which pods' token volumes need), and collects pods as a real
        cluster does. Each controller calls the API server with its own service account's token.
        ``controllers`` is its ``--controllers``."""
        healthz = free_port()
        self.controller_manager = self._spawn(
            "kube-controller-manager",
            [
                str(binaries.built("kube-controller-manager")),
                f"--kubeconfig={self.kubeconfig_of('system:kube-controller-manager')}",
                f"--authentication-kubeconfig={self.kubeconfig_of('system:kube-controller-manager')}",
                f"--authorization-kubeconfig={self.kubeconfig_of('system:kube-controller-manager')}",
                "--bind-address=127.0.0.1",
                f"--secure-port={healthz}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--controllers={','.join(controllers)}",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={self._path('apiserver-certs') / 'apiserver.crt'}",
                "--service-cluster-ip-range=10.96.0.0/24",
                # else it creates /usr/libexec/kubernetes/kubelet-plugins on the host
                f"--flex-volume-plugin-dir={self._path('flexvolume')}",
                "--v=1",
            ],
        )
        wait_for(
            lambda: self.controller_manager.check() or _get(f"https://127.0.0.1:{healthz}/healthz") == 200,
            60,
            f"kube-controller-manager to answer /healthz (log {self.controller_manager.log_path})",
            0.2,
        )
        self.wait_default_service_account("default")

    def wait_default_service_account(self, namespace: str, timeout: float = 60) -> None:
        """Wait for kube-controller-manager to make ``namespace``'s ``default`` ServiceAccount: until it
        has, the ServiceAccount admission plugin refuses every pod created there."""
        from kubernetes import client

        core = client.CoreV1Api(self.api)

        def made() -> bool:
            self.controller_manager.check()
            return bool(core.list_namespaced_service_account(namespace, field_selector="metadata.name=default").items)

        wait_for(made, timeout, f"the default ServiceAccount of namespace {namespace}", 0.1)

    def _apply_rbac(self) -> None:
        """Apply deploy/namespace.yaml and deploy/rbac.yaml, then mint tokens for their service accounts."""
        from kubernetes import client, utils

        for manifest in RBAC_MANIFESTS:
            utils.create_from_yaml(self.api, str(manifest))
        core = client.CoreV1Api(self.api)
        for account in ("gpushare-node-agent", "gpushare-extender"):
            request = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=86400)
            )
            token = core.create_namespaced_service_account_token(account, SYSTEM_NAMESPACE, request).status.token
            self.write_kubeconfig(account, token)

    def _start_nodes(self) -> None:
        image = build_busybox_image(self._path("busybox.tar"), (PAUSE_IMAGE, TEST_IMAGE, EXAMPLE_IMAGE))
        for index, (name, gpus) in enumerate(self.nodes_spec):
            bridge = bridge_name(self.workdir, index)
            self.nodes[name] = node = RealNode(name, gpus, self._path(name), bridge, pod_subnet(index))
            self._start_namespace(node)
            node.containerd = Containerd(node.base / "ctrd", PAUSE_IMAGE, node.in_namespace)
            (node.containerd.base / "cni-conf").mkdir(parents=True)
            (node.containerd.base / "cni-conf" / "10-pods.conflist").write_text(
                render_pod_network(node.bridge, node.subnet, node.base / "cni-ipam")
            )
            (node.containerd.base / "cni-bin").symlink_to(CNI_PLUGINS)
            node.containerd.start()
            node.containerd.import_image(image)
            self.start_agent(node)
            self.start_kubelet(node)
        for node in self.nodes.values():
            self.wait_node_ready(node)

    def _start_namespace(self, node: RealNode) -> None:
        """A process holding a private mount namespace with the node's own kubelet directories, and its
        own /var/lib/cni, where the CNI library caches each pod's network (nothing of it on the host)."""
        binds = [(node.device_plugin_dir, DEVICE_PLUGIN_DIR), (node.base / "pod-logs", POD_LOG_DIR),
                 (node.base / "cni-state", CNI_STATE_DIR)]  # fmt: skip
        for own, target in binds:
            own.mkdir(parents=True, exist_ok=True)
            target.mkdir(parents=True, exist_ok=True)
        script = " && ".join(f'mount --bind "${2 * i + 1}" "${2 * i + 2}"' for i in range(len(binds)))
        node.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             f"{script} && echo ready && exec sleep 2147483647", "sh", *(str(p) for bind in binds for p in bind)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
            cwd=node.base,
        )  # fmt: skip
        assert node.holder.stdout is not None
        if node.holder.stdout.readline().strip() != b"ready":
            node.holder.wait()
            err = node.holder.stderr.read().decode(errors="replace") if node.holder.stderr else ""
            raise ClusterError(f"node {node.name}: could not make its mount namespace: {err.strip()}")

    def write_kubeconfig(self, user: str, token: str) -> Path:
        """Its self-signed serving certificate (written once it serves) is the CA every kubeconfig trusts."""
        ca = self._path("apiserver-certs") / "apiserver.crt"
        path = self.kubeconfig_of(user)
        path.write_text(render_kubeconfig(self.server, user, token, ca))
        return path

    def kubeconfig_of(self, account: str) -> Path:
        return self._path(f"{_file_name(account)}.kubeconfig")

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
        node.agent = self._spawn(
            f"node-agent-{node.name}",
            [
                *node.in_namespace,
                sys.executable, "-m", "gpushare.cli", "node",
                "--node-name", node.name,
                "--kubeconfig", str(self.kubeconfig_of("gpushare-node-agent")),
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

    def start_kubelet(self, node: RealNode) -> None:
        port, node.kubelet_healthz_port = free_port(), free_port()
        config = node.base / "kubelet.yaml"
        config.write_text(
            render_kubelet_config(port, node.kubelet_healthz_port, node.cri_socket, self.node_taints.get(node.name, ()))
        )
        node.kubelet = self._spawn(
            f"kubelet-{node.name}",
            [
                *node.in_namespace,
                str(binaries.built("kubelet")),
                f"--config={config}",
                f"--kubeconfig={self.kubeconfig_of(f'system:node:{node.name}')}",
                f"--root-dir={node.base / 'kubelet'}",
                f"--cert-dir={node.base / 'kubelet-pki'}",
                f"--hostname-override={node.name}",
                "--node-ip=127.0.0.1",
                "--v=2",
            ],
        )

    def wait_node_ready(self, node: RealNode, timeout: float = 60, reported_after: float = 0.0) -> None:
        """Wait for Ready, gpu-mem on offer and the node agent ready, in a status kubelet reported after
        ``reported_after`` (epoch seconds) when given, and for kube-controller-manager to have lifted
        the node's not-ready taint (until then kube-scheduler places nothing there)."""
        from kubernetes import client

        core = client.CoreV1Api(self.api)

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

        what = f"node {node.name} to be Ready and untainted with {RESOURCE_MEM} (logs in {self.workdir})"
        wait_for(ready, timeout, what, 0.2)

    def _start_schedulers(self) -> None:
        template = yaml.safe_load(SCHEDULER_CONFIG.read_text())
        tls = None
        if self.extender_tls:
            shipped = next(iter(template.get("extenders") or []), {}).get("tlsConfig") or {}
            certs = self.extender_certs = make_certs(
                self._path("extender-tls"), (shipped.get("serverName", EXTENDER_SERVER_NAME),)
            )
            tls = SchedulerTls(certs.client.cert, certs.client.key, certs.ca)
        for name in self.scheduler_names:
            control = Control(name, free_port(), tls=tls is not None)
            self.controls.append(control)
            argv = [sys.executable, "-m", "gpushare.cli", "extender", "--port", str(control.extender_port),
                    "--kubeconfig", str(self.kubeconfig_of("gpushare-extender"))]  # fmt: skip
            if self.extender_certs is not None:
                control.extender_health_port = free_port()
                argv += ["--host", "127.0.0.1", "--health-host", "127.0.0.1",
                         "--health-port", str(control.extender_health_port),
                         "--tls-cert", self.extender_certs.server.cert, "--tls-key", self.extender_certs.server.key,
                         "--client-ca", self.extender_certs.ca]  # fmt: skip
            control.extender = self._spawn(
                f"extender-{name}", [*argv, "--policy", self.policy] if self.policy else argv
            )
            config = self._path(f"scheduler-{name}.yaml")
            control.healthz_port = free_port()
            config.write_text(
                render_scheduler_config(
                    self.kubeconfig_of("system:kube-scheduler"), control.extender_url, name, template, tls
                )
            )
            control.scheduler = self._spawn(f"kube-scheduler-{name}", scheduler_argv(config, control.healthz_port))
        for control in self.controls:
            wait_for(lambda ctl=control: ctl.ready(), 30, f"scheduler {control.scheduler_name} and its extender")

    # --- operations ------------------------------------------------------------------------------------

    def restart_kubelet(self, name: str) -> None:
        """Restart the node's kubelet and return once the device plugin has registered with the new one
        and kubelet has reported its resources since. Until then kubelet refuses GPU pods for want of
        devices, as any kubelet does after a restart."""
        node = self.nodes[name]
        self.stop_kubelet(name)
        restarted = time.time()
        self.start_kubelet(node)
        kubelet = node.kubelet

        def plugin_serves_again() -> bool:
            """kubelet recreated its socket and wiped the plugin's; the plugin's are back, newer than kubelet's."""
            kubelet.check()
            try:
                kubelet_made = (node.device_plugin_dir / "kubelet.sock").stat().st_ctime
                plugins = [p.stat().st_ctime for p in node.device_plugin_dir.glob("*.sock") if p.name != "kubelet.sock"]
            except FileNotFoundError:
                return False
            return kubelet_made >= restarted and bool(plugins) and min(plugins) >= kubelet_made

        wait_for(plugin_serves_again, 30, f"node {name}: the device plugin to serve the restarted kubelet")
        # heartbeats are stamped to the second
        self.wait_node_ready(node, reported_after=time.time() + 1)

    def stop_kubelet(self, name: str) -> None:
        """Stop the node's kubelet (:meth:`start_kubelet` starts a new one)."""
        node = self.nodes[name]
        assert node.kubelet is not None
        node.kubelet.stop()
        self.processes.remove(node.kubelet)

    def restart_agent(self, name: str) -> None:
        node = self.nodes[name]
        assert node.agent is not None
        node.agent.stop()
        self.processes.remove(node.agent)
        self.start_agent(node)

    def container_env(self, node: str, namespace: str, pod: str, container: str) -> dict[str, str]:
        """The environment of a running container's process, read with CRI ExecSync from the node's containerd."""
        ctrd = self.nodes[node].containerd
        assert ctrd is not None
        with grpc.insecure_channel(ctrd.address) as channel:
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
                raise ClusterError(f"no running container {container} of pod {namespace}/{pod} on node {node}")
            reply = stub.ExecSync(
                cri_pb2.ExecSyncRequest(container_id=found[0].id, cmd=["env"], timeout=10), timeout=20
            )
        if reply.exit_code != 0:
            raise ClusterError(f"env in {namespace}/{pod}/{container} exited {reply.exit_code}: {reply.stderr!r}")
        return dict(line.split("=", 1) for line in reply.stdout.decode().splitlines() if "=" in line)

    def node_inventory(self, name: str) -> NodeInventory:
        """The cards node ``name``'s advertiser published."""
        from kubernetes import client

        annotations = client.CoreV1Api(self.api).read_node(name).metadata.annotations or {}
        return parse_inventory(annotations.get(NODE_ANN_INVENTORY, ""), name)

    def endpoints(self) -> list[tuple[str, str]]:
        """Where each component answers, one row per component: its name and its URLs."""
        rows = [("kube-apiserver", f"{self.server} (kubectl --kubeconfig {self.kubeconfig})")]
        for control in self.controls:
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
        order = [p for p in self.processes if p.name.startswith(("kube-scheduler", "extender", "kubelet"))]
        order += [p for p in self.processes if p.name.startswith("node-agent")]
        for proc in order:
            with contextlib.suppress(Exception):
                proc.stop()
        for node in self.nodes.values():
            if node.containerd is not None:
                with contextlib.suppress(Exception):
                    node.containerd.close()
        for proc in reversed(self.processes):
            with contextlib.suppress(Exception):
                proc.stop()
        for node in self.nodes.values():
            if node.holder is not None and node.holder.poll() is None:
                node.holder.kill()
                node.holder.wait()
        for pid in processes_using(self.workdir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            wait_for(lambda: not processes_using(self.workdir), 10, f"the processes under {self.workdir} to end")
        except ClusterError as exc:
            log.warning("%s", exc)
        for node in self.nodes.values():
            remove_bridge(node.bridge)
        if self.api is not None:
            self.api.close()


def processes_using(path: Path) -> list[int]:
    """Processes whose command line, working directory, root or mount table lies under ``path``: every
    process a cluster in that directory started, container processes included, even one whose shim is
    gone (it shows its root inside its node's mount namespace, but its mounts name the snapshot here)."""
    inside = str(path).encode() + b"/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
            places = [os.readlink(entry / "cwd").encode(), os.readlink(entry / "root").encode()]
            mounts = (entry / "mountinfo").read_bytes()
        except OSError:
            continue
        if inside in argv or inside in mounts or any((p + b"/").startswith(inside) for p in places):
            found.append(int(entry.name))
    return found


def _file_name(user: str) -> str:
    return user.replace(":", "-")


@contextlib.contextmanager
def running_cluster(nodes: Sequence[tuple[str, str]], workdir: Path, **options: Any) -> Iterator[RealCluster]:
    cluster = RealCluster(nodes, workdir, **options)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
