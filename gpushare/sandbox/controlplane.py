"""The real cluster's control plane on loopback: etcd, kube-apiserver (a static token and a kubeconfig per
user) and kube-controller-manager (:class:`ControlPlane`), and per scheduler name a kube-scheduler with its
gpushare extender replica (:class:`Schedulers`), each among the cluster's processes."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpushare.sandbox import binaries
from gpushare.sandbox.certs import (
    Certs,
    kubelet_client_ca,
    make_certs,
    make_front_proxy_ca,
    make_kubelet_client,
)
from gpushare.sandbox.configfiles import (
    EXTENDER_SERVER_NAME,
    RBAC_MANIFESTS,
    SCHEDULER_CONFIG,
    Identity,
    Kubeconfigs,
    SchedulerTls,
    render_audit_policy,
    render_scheduler_config,
    render_token_file,
    taint,
)
from gpushare.sandbox.launch import Launcher, Process, free_port, http_status, wait_for

SYSTEM_NAMESPACE = "gpushare-system"
#: the gpushare components' users; with RBAC their deploy/rbac.yaml service accounts
NODE_AGENT_USER, EXTENDER_USER = "gpushare-node-agent", "gpushare-extender"
#: the user Kubernetes' default RBAC binds to kube-proxy's role (system:node-proxier)
KUBE_PROXY_USER = "system:kube-proxy"
#: seconds the service accounts' tokens last: longer than any session
TOKEN_SECONDS = 86400


def node_agent_user(node: str) -> str:
    """The kubeconfig of ``node``'s agent, with RBAC: the node agent's service account, its token bound
    to the Node."""
    return f"{NODE_AGENT_USER}@{node}"


def _token() -> str:
    return os.urandom(16).hex()


@dataclass
class ControlPlane:
    """etcd, kube-apiserver and kube-controller-manager, started by :meth:`start` among ``launcher``'s
    processes; each user (``admin``, the control plane's own, each node's and the gpushare components')
    gets a static token and a kubeconfig (:attr:`kubeconfigs`). With ``rbac`` the API server authorizes
    with RBAC and, with ``install_rbac`` too, the gpushare components use deploy/rbac.yaml's service
    accounts (without it, whatever installs gpushare brings its RBAC); ``audited_users``' requests go to
    :attr:`audit_log`. kube-apiserver listens on ``host``: loopback, or an address pods can reach."""

    launcher: Launcher
    rbac: bool = False
    audited_users: Sequence[str] = ()
    install_rbac: bool = True
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    admin: Identity = field(default_factory=lambda: Identity("gpushare-admin", _token(), ("system:masters",)))
    #: the administrator's API client, once the API server answers
    api: Any = None

    def __post_init__(self) -> None:
        # kube-apiserver's self-signed serving certificate (written once it serves) is the CA every
        # kubeconfig trusts
        self.kubeconfigs = Kubeconfigs(self.workdir, self.server, self._path("apiserver-certs") / "apiserver.crt")

    @property
    def workdir(self) -> Path:
        return self.launcher.workdir

    @property
    def server(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def audit_log(self) -> Path:
        return self._path("audit.log")

    def _path(self, name: str) -> Path:
        return self.workdir / name

    def start(self, node_names: Sequence[str], controllers: Sequence[str]) -> None:
        """etcd, kube-apiserver with a user per node of ``node_names``, then kube-controller-manager with
        ``controllers`` (its ``--controllers``) and, with RBAC, deploy/'s manifests applied."""
        from gpushare.kube.transport import load_api

        etcd_port, peer_port = free_port(), free_port()
        self.launcher.spawn(
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
        identities = [
            self.admin,
            Identity("system:kube-scheduler", _token()),
            Identity("system:kube-controller-manager", _token()),
            Identity(KUBE_PROXY_USER, _token()),
            *(Identity(f"system:node:{n}", _token(), ("system:nodes", "system:masters")) for n in node_names),
        ]
        if not self.rbac:
            # without RBAC the gpushare components are ordinary users; with it they use service accounts
            identities += [Identity(NODE_AGENT_USER, _token()), Identity(EXTENDER_USER, _token())]
        self._path("tokens.csv").write_text(render_token_file(identities))
        kubelet_client = make_kubelet_client(self.workdir)
        apiserver = self.launcher.spawn(
            "kube-apiserver",
            [
                str(binaries.built("kube-apiserver")),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={self.host}",
                # pods reach it through the Service kubernetes.default, whose endpoint this is
                *([] if ipaddress.ip_address(self.host).is_loopback else [f"--advertise-address={self.host}"]),
                f"--secure-port={self.port}",
                f"--cert-dir={self._path('apiserver-certs')}",
                f"--token-auth-file={self._path('tokens.csv')}",
                f"--authorization-mode={'RBAC' if self.rbac else 'AlwaysAllow'}",
                f"--service-account-key-file={sa_key}",
                f"--service-account-signing-key-file={sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                # to the kubelets (logs, exec) with the client certificate they require; their serving
                # certificates are self-signed, so with no --kubelet-certificate-authority they are
                # not verified (pkg/kubelet/client/kubelet_client.go)
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                # client CAs, as kubeadm sets them (its cluster CA, its front-proxy CA and the headers
                # beside it): kube-apiserver publishes them in kube-system/extension-apiserver-authentication,
                # which a kube-scheduler run as a pod reads to authenticate its own callers (metrics, probes)
                f"--client-ca-file={kubelet_client_ca(self.workdir)}",
                f"--requestheader-client-ca-file={make_front_proxy_ca(self.workdir)}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                # at the address the node reports: its name resolves nowhere (the default tries it first)
                "--kubelet-preferred-address-types=InternalIP",
                *self._audit_flags(),
            ],
        )

        def ready() -> bool:
            apiserver.check()
            return http_status(f"{self.server}/readyz", self.admin.token) == 200

        wait_for(ready, 60, f"kube-apiserver to answer /readyz (log {apiserver.log_path})", 0.2)
        for who in identities:
            self.kubeconfigs.write(who.user, who.token)
        self.api = load_api(str(self.kubeconfigs.path(self.admin.user)))
        self._start_controller_manager(sa_key, controllers)
        if self.rbac and self.install_rbac:
            self._apply_rbac()

    def _audit_flags(self) -> list[str]:
        if not self.audited_users:
            return []
        self._path("audit-policy.yaml").write_text(render_audit_policy(self.audited_users))
        return [f"--audit-policy-file={self._path('audit-policy.yaml')}", f"--audit-log-path={self.audit_log}"]

    def _start_controller_manager(self, sa_key: Path, controllers: Sequence[str]) -> None:
        """kube-controller-manager with its default controllers, as on any cluster: it lifts a node's
        not-ready taint once the node is Ready, makes each namespace's ``default`` ServiceAccount and
        publishes ``kube-root-ca.crt`` (which pods' token volumes need), and collects pods as a real
        cluster does. Each controller calls the API server with its own service account's token.
        ``controllers`` is its ``--controllers``."""
        healthz = free_port()
        kubeconfig = self.kubeconfigs.path("system:kube-controller-manager")
        self.controller_manager = self.launcher.spawn(
            "kube-controller-manager",
            [
                str(binaries.built("kube-controller-manager")),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={healthz}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--controllers={','.join(controllers)}",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={self.kubeconfigs.ca_file}",
                "--service-cluster-ip-range=10.96.0.0/24",
                # else it creates /usr/libexec/kubernetes/kubelet-plugins on the host
                f"--flex-volume-plugin-dir={self._path('flexvolume')}",
                "--v=1",
            ],
        )
        wait_for(
            lambda: self.controller_manager.check() or http_status(f"https://127.0.0.1:{healthz}/healthz") == 200,
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
        from kubernetes import utils

        for manifest in RBAC_MANIFESTS:
            utils.create_from_yaml(self.api, str(manifest))
        for account in (NODE_AGENT_USER, EXTENDER_USER):
            self.kubeconfigs.write(account, self._service_account_token(account))

    def _service_account_token(self, account: str, bound_to: Any = None) -> str:
        from kubernetes import client

        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=TOKEN_SECONDS, bound_object_ref=bound_to)
        )
        core = client.CoreV1Api(self.api)
        return core.create_namespaced_service_account_token(account, SYSTEM_NAMESPACE, request).status.token

    def register_node_agent(self, node: str, taints: Sequence[str] = ()) -> Path:
        """The kubeconfig of ``node``'s agent (:func:`node_agent_user`), with a token bound to the Node, as
        deploy/rbac.yaml's policy wants of it (the token's node-name extra). The Node must exist for
        that, and the agent runs before kubelet (it is kubelet's CRI runtime), so the Node is created
        here with the ``taints`` (``key=value:Effect``) kubelet would register it with; kubelet takes a
        Node that exists over, as after a restart. A DaemonSet pod's own token is bound to its pod and
        carries its node the same way."""
        from kubernetes import client

        body = {"metadata": {"name": node}, "spec": {"taints": [taint(t) for t in taints]}}
        created = client.CoreV1Api(self.api).create_node(body)
        ref = client.V1BoundObjectReference(api_version="v1", kind="Node", name=node, uid=created.metadata.uid)
        return self.kubeconfigs.write(node_agent_user(node), self._service_account_token(NODE_AGENT_USER, ref))

    def close(self) -> None:
        """Close the API client (the processes are ``launcher``'s to stop)."""
        if self.api is not None:
            self.api.close()


#: kube-scheduler's feature gates beside the extender, as docs/operations.md ("Wiring kube-scheduler to the
#: extender") has operators set them. A pod the extender refused is retried on every cluster event
#: (kube-scheduler's pkg/scheduler/schedule_one.go puts the pseudo-plugin "Extender" among its rejectors, and
#: its enqueue extension takes every event, kubernetes#122019); with SchedulerPopFromBackoffQ (beta, on
#: since 1.33, KEP-5142) an idle kube-scheduler pops such a pod from the back-off queue at once, so nothing
#: spaces the retries out. Off, the back-off (1 s doubling to podMaxBackoffSeconds, 10 s) holds.
SCHEDULER_FEATURE_GATES = ("SchedulerPopFromBackoffQ=false",)


def scheduler_argv(
    config: Path, port: int, open_paths: Sequence[str] = (), feature_gates: Sequence[str] = SCHEDULER_FEATURE_GATES
) -> list[str]:
    """kube-scheduler reading ``config``, serving /healthz and /metrics on 127.0.0.1:``port`` over HTTPS
    (its only listener since 1.23; /healthz needs no credentials, nor do ``open_paths``), with
    ``feature_gates`` (``NAME=BOOL``)."""
    argv = [
        str(binaries.built("kube-scheduler")),
        f"--config={config}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--v=2",
    ]
    if feature_gates:
        argv.append(f"--feature-gates={','.join(feature_gates)}")
    if open_paths:
        argv.append(f"--authorization-always-allow-paths={','.join(('/healthz', '/readyz', '/livez', *open_paths))}")
    return argv


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
        extender_ready = self.extender is None or http_status(f"{self.extender_health_url}/readyz") == 200
        return extender_ready and http_status(f"https://127.0.0.1:{self.healthz_port}/healthz") == 200


@dataclass
class Schedulers:
    """One kube-scheduler and one gpushare extender replica per name of ``names`` (pods choose with
    ``spec.schedulerName``), and one kube-scheduler with no extender per name of ``plain``, started by
    :meth:`start` among ``launcher``'s processes. With ``tls``, kube-scheduler reaches its extender over
    HTTPS with a client certificate, as deploy/ ships it."""

    launcher: Launcher
    kubeconfigs: Kubeconfigs
    names: Sequence[str] = ("default-scheduler",)
    #: kube-schedulers configured without the extender (DRA claims need none)
    plain: Sequence[str] = ()
    #: the extenders' ``--policy`` (empty: their default)
    policy: str = ""
    tls: bool = True
    controls: list[Control] = field(default_factory=list)
    #: the extender's CA and serving certificate, and kube-scheduler's client certificate
    certs: Certs | None = None

    def start(self) -> None:
        template = yaml.safe_load(SCHEDULER_CONFIG.read_text())
        tls = None
        if self.tls:
            shipped = next(iter(template.get("extenders") or []), {}).get("tlsConfig") or {}
            certs = self.certs = make_certs(
                self.launcher.workdir / "extender-tls", (shipped.get("serverName", EXTENDER_SERVER_NAME),)
            )
            tls = SchedulerTls(certs.client.cert, certs.client.key, certs.ca)
        for name in self.names:
            control = Control(name, free_port(), tls=tls is not None)
            self.controls.append(control)
            argv = [sys.executable, "-m", "gpushare.cli", "extender", "--port", str(control.extender_port),
                    "--kubeconfig", str(self.kubeconfigs.path(EXTENDER_USER))]  # fmt: skip
            if self.certs is not None:
                control.extender_health_port = free_port()
                argv += ["--host", "127.0.0.1", "--health-host", "127.0.0.1",
                         "--health-port", str(control.extender_health_port),
                         "--tls-cert", self.certs.server.cert, "--tls-key", self.certs.server.key,
                         "--client-ca", self.certs.ca]  # fmt: skip
            control.extender = self.launcher.spawn(
                f"extender-{name}", [*argv, "--policy", self.policy] if self.policy else argv
            )
            config = self.launcher.workdir / f"scheduler-{name}.yaml"
            control.healthz_port = free_port()
            config.write_text(
                render_scheduler_config(
                    self.kubeconfigs.path("system:kube-scheduler"), control.extender_url, name, template, tls
                )
            )
            control.scheduler = self.launcher.spawn(
                f"kube-scheduler-{name}", scheduler_argv(config, control.healthz_port)
            )
        for name in self.plain:
            control = Control(name, 0, healthz_port=free_port())
            self.controls.append(control)
            config = self.launcher.workdir / f"scheduler-{name}.yaml"
            config.write_text(
                render_scheduler_config(self.kubeconfigs.path("system:kube-scheduler"), None, name, template)
            )
            control.scheduler = self.launcher.spawn(
                f"kube-scheduler-{name}", scheduler_argv(config, control.healthz_port)
            )
        for control in self.controls:
            wait_for(lambda ctl=control: ctl.ready(), 30, f"scheduler {control.scheduler_name} and its extender")
