"""The real cluster's pod network: the simulated nodes share the host's network namespace, and each node's
pods get a bridge and a private subnet of their own (:func:`render_pod_network`), deleted on stop.

Isolated (the default), a pod reaches only its node's other pods. Routed (:class:`RoutedNetwork`, for a
cluster that runs gpushare as pods), the bridge holds the subnet's gateway and pods route to the cluster's
own ranges through it: the control plane and node addresses on a link of their own, the Service range, which
kube-proxy translates, and the other nodes' pods. Nothing is routed beyond those private ranges."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare.sandbox.launch import ClusterError

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


def render_pod_network(bridge: str, subnet: str, ipam_dir: Path, routes: Sequence[str] = ()) -> str:
    """A node's pod network (CNI): each pod gets an address in ``subnet`` on the node's own ``bridge``,
    and host-local keeps its leases in ``ipam_dir``. Without ``routes`` the bridge has no address on the
    host and the pods no route, so a pod reaches the other pods of its node and nothing beyond. With
    them, each is routed through the subnet's gateway (:func:`gateway`, which :func:`make_bridge` puts on
    the bridge). The plugin never makes the bridge a gateway itself (that would turn on the host's
    IP forwarding) and masquerades nothing, so it makes no iptables rule."""
    range_ = {"subnet": subnet, "gateway": gateway(subnet)} if routes else {"subnet": subnet}
    ipam: dict[str, object] = {"type": "host-local", "ranges": [[range_]], "dataDir": str(ipam_dir)}
    if routes:
        ipam["routes"] = [{"dst": dst, "gw": gateway(subnet)} for dst in routes]
    plugin = {"type": "bridge", "bridge": bridge, "isGateway": False, "ipMasq": False, "ipam": ipam}
    return json.dumps({"cniVersion": "0.4.0", "name": "gpushare-pods", "plugins": [plugin]})


def gateway(subnet: str) -> str:
    """The subnet's first address, where a routed node's bridge sits."""
    return str(next(ipaddress.ip_network(subnet).hosts()))


def install_pod_network(
    containerd_base: Path, bridge: str, subnet: str, ipam_dir: Path, routes: Sequence[str] = ()
) -> None:
    """Put the node's pod network where its containerd reads CNI configuration and plugins."""
    (containerd_base / "cni-conf").mkdir(parents=True)
    config = render_pod_network(bridge, subnet, ipam_dir, routes)
    (containerd_base / "cni-conf" / "10-pods.conflist").write_text(config)
    (containerd_base / "cni-bin").symlink_to(CNI_PLUGINS)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def make_bridge(bridge: str, subnet: str) -> None:
    """A routed node's bridge, up, with the subnet's gateway address (the host's route to its pods)."""
    _ip("link", "add", "name", bridge, "type", "bridge")
    _ip("addr", "add", f"{gateway(subnet)}/{ipaddress.ip_network(subnet).prefixlen}", "dev", bridge)
    _ip("link", "set", bridge, "up")


@dataclass(frozen=True, slots=True)
class RoutedNetwork:
    """The addresses of a cluster whose pods reach its control plane: ``link`` is a bridge without ports
    (these kernels have no dummy links) holding the control plane's address and one per node; the
    Service range is routed onto it too, so a packet for a Service that kube-proxy has not translated
    (yet) is dropped there instead of leaving the machine by its default route. Pods route to
    :attr:`routes`."""

    link: str
    control_plane: str = "10.243.0.1"
    service_range: str = "10.96.0.0/24"
    pod_ranges: str = "10.246.0.0/16"

    def node_address(self, index: int) -> str:
        return str(ipaddress.ip_address(self.control_plane) + 10 + index)

    def pod_subnet(self, index: int) -> str:
        return str(list(ipaddress.ip_network(self.pod_ranges).subnets(new_prefix=24))[index])

    @property
    def routes(self) -> tuple[str, ...]:
        nodes = ipaddress.ip_network(f"{self.control_plane}/24", strict=False)
        return (str(nodes), self.service_range, self.pod_ranges)

    def create(self, nodes: int) -> None:
        """The link with the control plane's and ``nodes`` nodes' addresses, and the Service route."""
        if (Path("/sys/class/net") / self.link).exists():
            raise ClusterError(f"link {self.link} exists: another cluster with this directory is running")
        _ip("link", "add", self.link, "type", "bridge")
        for address in (self.control_plane, *(self.node_address(i) for i in range(nodes))):
            _ip("addr", "add", f"{address}/32", "dev", self.link)
        _ip("link", "set", self.link, "up")
        _ip("route", "add", self.service_range, "dev", self.link, "src", self.control_plane)

    def remove(self) -> None:
        remove_bridge(self.link)


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
