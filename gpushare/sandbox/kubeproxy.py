"""kube-proxy for a cluster whose pods use Services, in nftables mode.

The simulated nodes share the host's network namespace, so one kube-proxy serves them all: every node's
would write the same rules into the same namespace. Its rules live in tables of their own (``ip
kube-proxy`` and ``ip6 kube-proxy``), which :func:`remove_tables` deletes after it stops; it is told to
leave the machine's conntrack settings as they are. Only one such cluster can run on a machine at a time.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from gpushare.sandbox import binaries
from gpushare.sandbox.launch import ClusterError

#: the nftables tables kube-proxy's nftables mode keeps its rules in
TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))


def render_config(kubeconfig: Path, hostname: str, cluster_cidr: str, healthz_port: int, metrics_port: int) -> str:
    """kube-proxy's configuration: nftables mode, traffic from outside ``cluster_cidr`` to a Service
    masqueraded, health and metrics on loopback, and every conntrack setting left as the machine has it
    (a 0 there means "don't set")."""
    return yaml.safe_dump(
        {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "nftables",
            "hostnameOverride": hostname,
            "clusterCIDR": cluster_cidr,
            "healthzBindAddress": f"127.0.0.1:{healthz_port}",
            "metricsBindAddress": f"127.0.0.1:{metrics_port}",
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        },
        sort_keys=False,
    )


def argv(config: Path) -> list[str]:
    return [str(binaries.built("kube-proxy")), f"--config={config}", "--v=1"]


def _nft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nft", *args], capture_output=True, text=True, check=False)


def tables_present() -> list[str]:
    """The kube-proxy tables this network namespace holds (``family name``)."""
    return [f"{family} {name}" for family, name in TABLES if _nft("list", "table", family, name).returncode == 0]


def check_free() -> None:
    """:class:`ClusterError` when another kube-proxy's rules are here (another such cluster runs)."""
    if present := tables_present():
        raise ClusterError(
            f"nftables already holds kube-proxy's table(s) {', '.join(present)}: another cluster with"
            f" kube-proxy runs on this machine (or one was killed; then `nft delete table` them)"
        )


def remove_tables() -> None:
    """Delete kube-proxy's tables (kube-proxy leaves its rules in place when it stops)."""
    for family, name in TABLES:
        done = _nft("delete", "table", family, name)
        if done.returncode != 0 and "No such file" not in done.stderr:
            raise ClusterError(f"nft delete table {family} {name}: {done.stderr.strip()}")
