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


def _token(workdir: Path) -> str:
    """The cluster's links' names carry this token of its directory: the nodes, and any other cluster on
    this machine, share the host's network namespace."""
    return hashlib.sha256(str(workdir).encode()).hexdigest()[:6]


def bridge_name(workdir: Path, index: int) -> str:
    """The bridge of the cluster's ``index``-th node."""
    return f"{BRIDGE_PREFIX}{_token(workdir)}n{index}"


def routed_link(workdir: Path) -> str:
    """The link holding a routed cluster's control-plane and node addresses (:class:`RoutedNetwork`)."""
    return f"{BRIDGE_PREFIX}{_token(workdir)}cp"


def node_link(workdir: Path) -> str:
    """The link holding the nodes' addresses of a cluster with isolated pods (:class:`NodeAddresses`)."""
    return f"{BRIDGE_PREFIX}{_token(workdir)}nd"


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


def make_address_link(link: str, addresses: Sequence[str]) -> None:
    """A bridge without ports (these kernels have no dummy links), up, holding each of ``addresses`` (/32)
    as an address of this machine."""
    _ip("link", "add", link, "type", "bridge")
    for address in addresses:
        _ip("addr", "add", f"{address}/32", "dev", link)
    _ip("link", "set", link, "up")


def make_bridge(bridge: str, subnet: str) -> None:
    """A routed node's bridge, up, with the subnet's gateway address (the host's route to its pods).

    Its pods reach one another's Services, as on any cluster, through two settings of this bridge alone,
    which go with it: IPv4 forwarding of what arrives on it (the kernel asks the incoming device's own
    ``forwarding``, so the machine's ``ip_forward`` stays as it is), for a pod to reach the pods of
    another node and a Service's endpoints once kube-proxy has translated its address; and its frames
    through netfilter (``nf_call_iptables``), so that the reply of an endpoint on the same bridge, which
    never leaves it, is translated back from the Service's address too (what ``br_netfilter`` and
    ``net.bridge.bridge-nf-call-iptables`` do for a kubeadm node)."""
    _ip("link", "add", "name", bridge, "type", "bridge")
    _ip("link", "set", bridge, "type", "bridge", "nf_call_iptables", "1")
    forwarding = Path("/proc/sys/net/ipv4/conf") / bridge / "forwarding"
    try:
        forwarding.write_text("1\n")
    except OSError as exc:
        raise ClusterError(f"{forwarding}: {exc}") from None
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
        """The link with the control plane's and ``nodes`` nodes' addresses, and the Service route. The
        addresses are fixed, so the cluster leases :data:`ROUTED_LEASE` first; :meth:`remove` undoes
        whatever part of this was done (the route goes with the link)."""
        make_address_link(self.link, (self.control_plane, *(self.node_address(i) for i in range(nodes))))
        _ip("route", "add", self.service_range, "dev", self.link, "src", self.control_plane)

    def remove(self) -> None:
        remove_bridge(self.link)


#: the lease of :class:`RoutedNetwork`'s fixed addresses and routes (see :mod:`~gpushare.sandbox.hostlease`)
ROUTED_LEASE = "routed-network"
#: the blocks of node addresses, a /24 each, that clusters with isolated pods lease one at a time
NODE_BLOCKS = ipaddress.ip_network("10.245.0.0/16")
NODE_BLOCK_LEASE = "node-addresses"
NODE_BLOCK_COUNT = 2 ** (24 - NODE_BLOCKS.prefixlen)


@dataclass(frozen=True, slots=True)
class NodeAddresses:
    """The nodes' own addresses in a cluster with isolated pods, for kubelet's ``--node-ip`` and its
    server, so that kube-apiserver reaches each node's kubelet (``kubectl logs``, ``exec``) at the address
    the node reports. kubelet refuses a loopback, link-local or multicast node IP and one that is not on
    one of the host's interfaces (``validateNodeIP``, pkg/kubelet/kubelet_node_status.go), so they sit on
    a port-less link of the cluster's own, /32 each, in block :attr:`block` of :data:`NODE_BLOCKS`, which
    the cluster leases; no pod has a route there."""

    link: str
    block: int

    def address(self, index: int) -> str:
        return str(NODE_BLOCKS.network_address + (self.block << 8) + 10 + index)

    def create(self, nodes: int) -> None:
        make_address_link(self.link, [self.address(i) for i in range(nodes)])

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
