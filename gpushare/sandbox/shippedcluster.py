"""A real cluster that gpushare is installed into the way an operator installs it: with Helm (or the
manifests of deploy/), from the image built here, following docs/operations.md.

Until then nothing of gpushare runs. The cluster is what an operator starts from:

- etcd, kube-apiserver with RBAC and kube-controller-manager (:class:`~gpushare.sandbox.controlplane.ControlPlane`)
  on an address pods reach;
- kube-proxy, so Services work (:mod:`~gpushare.sandbox.kubeproxy`);
- a control-plane "machine": a mount namespace with its own ``/etc/kubernetes`` (kube-scheduler's
  kubeconfig in ``scheduler.conf``, the administrator's in ``admin.conf``, as kubeadm leaves them) where
  kube-scheduler runs as it comes, with no configuration file; only an operator who patches it (the
  guide's "Patch the default scheduler") has it restarted with one (:meth:`ShippedCluster.restart_scheduler`,
  what kubelet does when a static pod's manifest changes);
- per node a machine with the paths a real host's programs use (:class:`~gpushare.sandbox.realnode.RealNode`
  with ``host_paths``): containerd 2 with the gpushare image imported and NRI on at its default socket,
  ``/var/run/nri/nri.sock`` in the node's own ``/run``, as containerd 2 comes; a kubelet on containerd's
  socket configured from ``/var/lib/kubelet/config.yaml``; and a fake NVML driver presenting the node's
  machine where the NVIDIA GPU operator puts the driver's library;
- a routed pod network on private addresses (:class:`~gpushare.sandbox.podnetwork.RoutedNetwork`).

Commands an operator runs on a machine run there with :meth:`ShippedCluster.run_on`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.process import signals_ignored
from gpushare.sandbox import binaries, kubeproxy
from gpushare.sandbox.containerd import PAUSE_IMAGE, TEST_IMAGE, build_busybox_image
from gpushare.sandbox.controlplane import KUBE_PROXY_USER, SCHEDULER_FEATURE_GATES, ControlPlane
from gpushare.sandbox.fakenvml import FakeNvmlError, build_with_machine
from gpushare.sandbox.hostlease import Lease, claim
from gpushare.sandbox.launch import ClusterError, Launcher, Process, free_port, http_status, wait_for
from gpushare.sandbox.mountns import MountNamespace
from gpushare.sandbox.podnetwork import (
    ROUTED_LEASE,
    RoutedNetwork,
    bridge_name,
    make_bridge,
    remove_bridge,
    routed_link,
)
from gpushare.sandbox.realcluster import EXAMPLE_IMAGE, MAX_WORKDIR
from gpushare.sandbox.realnode import NodeRunner, RealNode, stop_nodes

#: the control-plane machine's kubeconfig directory, as kubeadm lays it out
ETC_KUBERNETES = Path("/etc/kubernetes")
#: where an operator points kube-scheduler at its configuration (docs/operations.md)
SCHEDULER_CONFIG = ETC_KUBERNETES / "scheduler-config.yaml"
#: the node name every machine of a command answers to: the control plane's
CONTROL_PLANE = "control-plane"


@dataclass
class ShippedCluster:
    """Start with :meth:`start`, stop with :meth:`stop` (which ends every process, mount, link and
    nftables table it made). ``nodes_spec`` is (node name, fake NVML machine) per node; ``images`` are
    image archives every node's containerd imports."""

    nodes_spec: Sequence[tuple[str, str]]
    workdir: Path
    images: Sequence[Path] = ()
    nodes: dict[str, RealNode] = field(default_factory=dict)
    scheduler: Process | None = None

    def __post_init__(self) -> None:
        if len(str(self.workdir)) > MAX_WORKDIR:
            raise ClusterError(f"workdir {self.workdir} is too long: unix socket paths under it must stay short")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._started = False
        self.network = RoutedNetwork(routed_link(self.workdir))
        self._lease: Lease | None = None
        self.launcher = Launcher(self.workdir)
        self.control_plane = ControlPlane(self.launcher, rbac=True, install_rbac=False, host=self.network.control_plane)
        self.node_runner = NodeRunner(self.launcher, self.control_plane.kubeconfigs)
        self.control_machine = MountNamespace(
            "the control-plane machine", self.workdir, [(self.workdir / "etc-kubernetes", ETC_KUBERNETES)]
        )
        self._network_made = False

    @property
    def api(self) -> Any:
        """The administrator's API client."""
        return self.control_plane.api

    @property
    def kubeconfig(self) -> Path:
        """The administrator's kubeconfig."""
        return self.control_plane.kubeconfigs.path(self.control_plane.admin.user)

    # --- start -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Bring everything up; on failure stop what was started and raise :class:`ClusterError`. The
        network's addresses are fixed, so a second such cluster is refused, naming the first, before it
        changes anything on the host; each part's undo is registered before the part is made."""
        self._started = True
        try:
            what = f"the routed network ({self.network.control_plane}, Services {self.network.service_range})"
            self._lease = claim(ROUTED_LEASE, self.workdir, what)
            if self._lease.previous is not None:  # what a killed cluster left (its lease was free)
                remove_bridge(routed_link(self._lease.previous))
            kubeproxy.check_free()
            self._network_made = True
            self.network.create(len(self.nodes_spec))
            self.control_plane.start([name for name, _ in self.nodes_spec], ("*",))
            self._start_control_machine()
            self.restart_scheduler(None)
            self._start_nodes()
            self._start_kube_proxy()
        except BaseException:
            self.stop()
            raise

    def _start_control_machine(self) -> None:
        etc = self.workdir / "etc-kubernetes"
        etc.mkdir(exist_ok=True)
        kubeconfigs = self.control_plane.kubeconfigs
        for name, user in (("scheduler.conf", "system:kube-scheduler"), ("admin.conf", self.control_plane.admin.user)):
            (etc / name).write_bytes(kubeconfigs.path(user).read_bytes())
        self.control_machine.start()

    def _start_nodes(self) -> None:
        busybox = build_busybox_image(self.workdir / "busybox.tar", (PAUSE_IMAGE, TEST_IMAGE, EXAMPLE_IMAGE))
        for index, (name, machine) in enumerate(self.nodes_spec):
            try:
                library = build_with_machine(machine)
            except FakeNvmlError as exc:
                raise ClusterError(f"node {name}: {exc}") from None
            bridge = bridge_name(self.workdir, index)
            subnet = self.network.pod_subnet(index)
            node = RealNode(name, f"nvml:{machine}", self.workdir / name, bridge, subnet, host_paths=True,
                            address=self.network.node_address(index), nvml_library=library)  # fmt: skip
            self.nodes[name] = node
            make_bridge(bridge, subnet)
            node.start_namespace()
            node.start_containerd([busybox, *self.images], self.network.routes)
            self.node_runner.start_kubelet(node)
        for node in self.nodes.values():
            self.wait_node_ready(node)

    def _start_kube_proxy(self) -> None:
        kubeconfig = self.control_plane.kubeconfigs.path(KUBE_PROXY_USER)
        config, healthz = self.workdir / "kube-proxy.yaml", free_port()
        first = next(iter(self.nodes))
        config.write_text(kubeproxy.render_config(kubeconfig, first, self.network.pod_ranges, healthz, free_port()))
        proxy = self.launcher.spawn("kube-proxy", kubeproxy.argv(config))
        wait_for(
            lambda: proxy.check() or http_status(f"http://127.0.0.1:{healthz}/healthz") == 200,
            60,
            f"kube-proxy to answer /healthz (log {proxy.log_path})",
            0.2,
        )

    # --- operations ------------------------------------------------------------------------------------

    def restart_scheduler(self, config: Path | None = SCHEDULER_CONFIG) -> None:
        """(Re)start kube-scheduler on the control-plane machine with ``config`` (a path there), or with
        only its kubeconfig when None, as kubelet restarts its static pod when the manifest changes; wait
        until it serves."""
        if self.scheduler is not None:
            self.launcher.stop(self.scheduler)
        port = free_port()
        # docs/operations.md's step 2: the configuration, and the feature gates the extender wants
        source = (
            [f"--config={config}", f"--feature-gates={','.join(SCHEDULER_FEATURE_GATES)}"]
            if config
            else [f"--kubeconfig={ETC_KUBERNETES / 'scheduler.conf'}"]
        )
        argv = [*self.control_machine.prefix, str(binaries.built("kube-scheduler")), *source,
                "--bind-address=127.0.0.1", f"--secure-port={port}", "--v=2"]  # fmt: skip
        scheduler = self.scheduler = self.launcher.spawn("kube-scheduler", argv)
        wait_for(
            lambda: scheduler.check() or http_status(f"https://127.0.0.1:{port}/healthz") == 200,
            60,
            f"kube-scheduler to answer /healthz (log {scheduler.log_path})",
            0.2,
        )

    def restart_kubelet(self, name: str) -> None:
        """Restart the node's kubelet (``systemctl restart kubelet``) and wait until the new one reports
        the node Ready."""
        node = self.nodes[name]
        self.node_runner.stop_kubelet(node)
        restarted = time.time()
        self.node_runner.start_kubelet(node)
        # heartbeats are stamped to the second
        self.wait_node_ready(node, reported_after=restarted + 1)

    def wait_node_ready(self, node: RealNode, timeout: float = 60, reported_after: float = 0.0) -> None:
        """See :meth:`NodeRunner.wait_ready`: Ready and untainted (gpushare, if installed, runs as pods)."""
        self.node_runner.wait_ready(node, self.api, timeout, reported_after)

    def machine_prefix(self, machine: str) -> list[str]:
        """The command prefix that runs a program on ``machine``: a node's name or :data:`CONTROL_PLANE`."""
        if machine == CONTROL_PLANE:
            return self.control_machine.prefix
        if machine not in self.nodes:
            raise ClusterError(f"no machine {machine!r}: the nodes are {', '.join(self.nodes)}")
        return self.nodes[machine].in_namespace

    def run_on(
        self, machine: str, script: str, cwd: Path, env: Mapping[str, str] | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """``bash -e -o pipefail -c script`` on ``machine`` as root, with the cluster's binaries and this
        Python's scripts on PATH and the administrator's kubeconfig in KUBECONFIG (kubeadm's admin.conf);
        its whole process group is killed if it outlives ``timeout``."""
        path = f"{binaries.bin_dir()}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        full_env = {**os.environ, "PATH": path, "KUBECONFIG": str(self.kubeconfig), **(env or {})}
        # entering a mount namespace starts at its root directory
        argv = [
            *self.machine_prefix(machine),
            "bash",
            "-e",
            "-o",
            "pipefail",
            "-c",
            f"cd {shlex.quote(str(cwd))}\n{script}",
        ]
        proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
            raise ClusterError(f"on {machine}: still running after {timeout:g} s:\n{script}\n{output}") from None
        return subprocess.CompletedProcess(argv, proc.returncode, output, "")

    # --- stop ------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process and container, end the machines' namespaces, delete the bridges, the
        cluster's link and kube-proxy's tables. Signals wait until it is done."""
        if not self._started:
            return
        with signals_ignored():
            stop_nodes(self.launcher, list(self.nodes.values()), ("kube-scheduler", "kubelet"))
            self.control_machine.end()
            if self._network_made:
                self.network.remove()
                with contextlib.suppress(ClusterError):
                    kubeproxy.remove_tables()
            self.control_plane.close()
            if self._lease is not None:
                self._lease.release()
        self._started = False


def shipped_cluster_available() -> str | None:
    """None when a :class:`ShippedCluster` can run here, else why not (a reason to skip)."""
    from gpushare.sandbox.fakenvml import gcc_missing
    from gpushare.sandbox.realcluster import realcluster_available

    return (
        realcluster_available()
        or binaries.missing(("kube-proxy", "crictl", "helm"))
        or binaries.host_tool_missing(("nft",))
        or gcc_missing()
    )
