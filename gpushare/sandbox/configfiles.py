"""The real cluster's configuration files, rendered by pure functions: the API server's static tokens and
audit policy, one kubeconfig per user, kube-scheduler's configuration (``deploy/scheduler-config.yaml``
with only what differs on this machine) and each kubelet's."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpushare.sandbox.launch import ClusterError

REPO = Path(__file__).resolve().parents[2]
SCHEDULER_CONFIG = REPO / "deploy" / "scheduler-config.yaml"
RBAC_MANIFESTS = (REPO / "deploy" / "namespace.yaml", REPO / "deploy" / "rbac.yaml")
#: the server name kube-scheduler checks the extender's certificate against without a shipped one
EXTENDER_SERVER_NAME = "gpushare-extender.gpushare-system.svc"


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


def render_audit_policy(users: Sequence[str]) -> str:
    """kube-apiserver's ``--audit-policy-file``: the verb, resource and user of each completed request
    of ``users``, nothing of anyone else's."""
    return json.dumps(
        {
            "apiVersion": "audit.k8s.io/v1",
            "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "users": list(users)}, {"level": "None"}],
        }
    )


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


@dataclass(frozen=True, slots=True)
class Kubeconfigs:
    """One kubeconfig per user of the API server at ``server``, in ``directory``, each trusting
    ``ca_file`` (kube-apiserver's self-signed serving certificate, written once it serves)."""

    directory: Path
    server: str
    ca_file: Path

    def path(self, user: str) -> Path:
        return self.directory / f"{user.replace(':', '-')}.kubeconfig"

    def write(self, user: str, token: str) -> Path:
        path = self.path(user)
        path.write_text(render_kubeconfig(self.server, user, token, self.ca_file))
        return path


@dataclass(frozen=True, slots=True)
class SchedulerTls:
    """kube-scheduler's side of its TLS connection to the extender: its client certificate and key, and
    the CA that signed the extender's serving certificate."""

    cert_file: str
    key_file: str
    ca_file: str


def render_scheduler_config(
    kubeconfig: Path,
    extender_url: str | None,
    scheduler_name: str,
    template: Mapping[str, Any],
    tls: SchedulerTls | None = None,
    client_rate: tuple[float, int] | None = None,
) -> str:
    """``deploy/scheduler-config.yaml`` as shipped (``kubescheduler.config.k8s.io/v1``), with only what
    differs on this machine put in: the kubeconfig, one profile named ``scheduler_name``, no leader
    election, and each extender's URL and the files of its ``tlsConfig`` (``tls``; without TLS when
    None), or no extender when ``extender_url`` is None. ``client_rate`` sets ``clientConnection``'s
    ``qps`` and ``burst``."""
    config = {key: value for key, value in template.items() if key != "extenders"}
    if extender_url is not None:
        config["extenders"] = [_extender_entry(e, extender_url, tls) for e in template.get("extenders") or []]
        if not config["extenders"]:
            raise ClusterError(f"{SCHEDULER_CONFIG} has no extenders block")
    config["clientConnection"] = {**(template.get("clientConnection") or {}), "kubeconfig": str(kubeconfig)}
    if client_rate is not None:
        config["clientConnection"].update(qps=client_rate[0], burst=client_rate[1])
    config["leaderElection"] = {"leaderElect": False}
    config["profiles"] = [{"schedulerName": scheduler_name}]
    return yaml.safe_dump(config, sort_keys=False)


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


def render_kubelet_config(
    port: int,
    healthz_port: int,
    runtime_socket: Path,
    volume_plugin_dir: Path,
    taints: Sequence[str] = (),
    address: str = "127.0.0.1",
    cgroup_root: str = "",
    client_ca: Path | None = None,
) -> str:
    """Kubelet settings for a node that shares its machine with other simulated nodes: its server on
    ``address`` (loopback, or the node's own address), health on loopback, no QoS cgroups or
    node-allocatable enforcement (they would be shared), no evictions. The runtime is ``runtime_socket``;
    ``taints`` (``key=value:Effect``) are registered with the node. With ``cgroup_root`` (the node's own,
    see :mod:`~gpushare.sandbox.nodecgroups`), each pod gets a cgroup below it (``cgroupsPerQOS``), as
    on a real node. These machines run cgroup v1, which kubelet refuses from 1.35 on unless told otherwise.
    With ``client_ca`` its server takes only clients with a certificate that CA signed (kube-apiserver's,
    for logs and exec), else anyone (a server on loopback only)."""
    return yaml.safe_dump(
        {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{runtime_socket}",
            "failCgroupV1": False,
            "volumePluginDir": str(volume_plugin_dir),
            "registerWithTaints": [taint(t) for t in taints],
            "address": address,
            "port": port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz_port,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": bool(cgroup_root),
            **({"cgroupRoot": cgroup_root} if cgroup_root else {}),
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "authentication": {
                "anonymous": {"enabled": client_ca is None},
                "webhook": {"enabled": False},
                **({"x509": {"clientCAFile": str(client_ca)}} if client_ca is not None else {}),
            },
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


def taint(spec: str) -> dict[str, str]:
    """``key=value:Effect`` (or ``key:Effect``) as a Taint object."""
    key_value, _, effect = spec.rpartition(":")
    key, _, value = key_value.partition("=")
    if not key or not effect:
        raise ClusterError(f"taint {spec!r}: expected key=value:Effect")
    return {"key": key, "value": value, "effect": effect} if value else {"key": key, "effect": effect}
