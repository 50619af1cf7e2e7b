"""The real cluster's pod network: the simulated nodes share the host's network namespace, and each node's
pods get a bridge and a private subnet of their own (:func:`render_pod_network`), deleted on stop."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

CNI_PLUGINS = Path("/usr/lib/cni")
#: the CNI plugins a node's pod network uses (containerd adds each pod's loopback itself)
CNI_PLUGIN_NAMES = ("bridge", "host-local", "loopback")
#: the bridges' names are this, a token of the cluster and the node's index (Linux allows 15 bytes)
BRIDGE_PREFIX = "gs"


def cni_plugins_missing() -> str | None:
    """None when the CNI plugins are installed, else which one is missing and how to install it."""
    for plugin in CNI_PLUGIN_NAMES:
        if not (CNI_PLUGINS / plugin).is_file():
            return f"{CNI_PLUGINS / plugin} is missing (apt-get install -y containernetworking-plugins)"
    return None


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


def install_pod_network(containerd_base: Path, bridge: str, subnet: str, ipam_dir: Path) -> None:
    """Put the node's pod network where its containerd reads CNI configuration and plugins."""
    (containerd_base / "cni-conf").mkdir(parents=True)
    (containerd_base / "cni-conf" / "10-pods.conflist").write_text(render_pod_network(bridge, subnet, ipam_dir))
    (containerd_base / "cni-bin").symlink_to(CNI_PLUGINS)


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
