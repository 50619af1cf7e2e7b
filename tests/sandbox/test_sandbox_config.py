"""The real cluster's pod network, kube-proxy's settings, and what a failed run keeps, without starting
anything."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import yaml

from gpushare.sandbox import kubeproxy
from gpushare.sandbox.configfiles import render_kubelet_config
from gpushare.sandbox.podnetwork import (
    NODE_BLOCK_COUNT,
    NODE_BLOCKS,
    NodeAddresses,
    RoutedNetwork,
    bridge_name,
    pod_subnet,
    render_pod_network,
)
from gpushare.sandbox.printout import keep_only_logs


def test_each_node_of_each_cluster_has_a_bridge_name_linux_accepts_and_no_other_has() -> None:
    names = [bridge_name(Path(f"/tmp/gpushare-sandbox-{run}"), index) for run in ("a", "b") for index in range(256)]
    assert len(set(names)) == len(names)
    assert max(len(name) for name in names) <= 15  # IFNAMSIZ - 1
    assert bridge_name(Path("/tmp/x"), 1) == bridge_name(Path("/tmp/x"), 1)  # found again on stop


def test_each_node_has_a_private_subnet_of_its_own() -> None:
    subnets = [ipaddress.ip_network(pod_subnet(index)) for index in range(256)]
    assert all(subnet.is_private for subnet in subnets)
    assert not any(a.overlaps(b) for i, a in enumerate(subnets) for b in subnets[i + 1 :])


def test_the_pod_network_reaches_nothing_beyond_the_node() -> None:
    config = json.loads(render_pod_network("gsabcdefn0", "10.244.0.0/24", Path("/tmp/run/node-a/cni-ipam")))
    (plugin,) = config["plugins"]
    assert plugin["type"] == "bridge" and plugin["bridge"] == "gsabcdefn0"
    # no address on the host's side, no default route in the pod, no masquerading (no iptables rules)
    assert plugin["isGateway"] is False and plugin["ipMasq"] is False and "isDefaultGateway" not in plugin
    assert "routes" not in plugin["ipam"]
    assert plugin["ipam"] == {
        "type": "host-local",
        "ranges": [[{"subnet": "10.244.0.0/24"}]],
        "dataDir": "/tmp/run/node-a/cni-ipam",
    }


def test_a_routed_pod_network_reaches_the_clusters_ranges_and_nothing_else() -> None:
    network = RoutedNetwork("gsabcdefcp")
    config = json.loads(render_pod_network("gsabcdefn1", network.pod_subnet(1), Path("/x"), network.routes))
    (plugin,) = config["plugins"]
    # the bridge is never made a gateway by the plugin: that would turn on the host's IP forwarding
    assert plugin["isGateway"] is False and plugin["ipMasq"] is False
    ipam = plugin["ipam"]
    assert ipam["ranges"] == [[{"subnet": "10.246.1.0/24", "gateway": "10.246.1.1"}]]
    routed = {ipaddress.ip_network(r["dst"]) for r in ipam["routes"]}
    assert all(r["gw"] == "10.246.1.1" for r in ipam["routes"])
    assert not any(net.prefixlen == 0 for net in routed)  # no default route: nothing beyond the cluster
    for address in (network.control_plane, network.node_address(0), network.node_address(1), "10.96.0.1"):
        assert any(ipaddress.ip_address(address) in net for net in routed), address
    assert all(net.is_private for net in routed)


def test_a_routed_clusters_addresses_are_private_and_distinct() -> None:
    network = RoutedNetwork("gsabcdefcp")
    nodes = [network.node_address(i) for i in range(100)]
    assert len(set(nodes)) == 100 and network.control_plane not in nodes
    assert all(ipaddress.ip_address(a).is_private for a in nodes)
    subnets = [ipaddress.ip_network(network.pod_subnet(i)) for i in range(100)]
    assert not any(a.overlaps(b) for i, a in enumerate(subnets) for b in subnets[i + 1 :])
    assert not ipaddress.ip_network(network.service_range).overlaps(ipaddress.ip_network(network.pod_ranges))


def test_node_addresses_are_ones_kubelet_takes_distinct_per_cluster_and_apart_from_the_others() -> None:
    """kubelet's --node-ip may not be loopback, link-local or multicast (validateNodeIP)."""
    blocks = [NodeAddresses(f"gs{slot}nd", slot) for slot in range(NODE_BLOCK_COUNT)]
    addresses = [ipaddress.ip_address(block.address(index)) for block in blocks for index in range(64)]
    assert len(set(addresses)) == len(addresses) and all(a in NODE_BLOCKS for a in addresses)
    assert not any(a.is_loopback or a.is_link_local or a.is_multicast or not a.is_private for a in addresses)
    routed = RoutedNetwork("gsabcdefcp")
    taken = [ipaddress.ip_network(r) for r in (*routed.routes, *(pod_subnet(i) for i in range(256)))]
    assert not any(NODE_BLOCKS.overlaps(net) for net in taken)


def test_a_kubelet_on_a_node_address_takes_only_clients_its_ca_signed() -> None:
    config = yaml.safe_load(
        render_kubelet_config(
            10250, 10248, Path("/run/cri.sock"), Path("/fv"), (), "10.245.0.10", client_ca=Path("/ca")
        )
    )
    assert config["address"] == "10.245.0.10" and config["healthzBindAddress"] == "127.0.0.1"
    assert config["authentication"] == {
        "anonymous": {"enabled": False},
        "webhook": {"enabled": False},
        "x509": {"clientCAFile": "/ca"},
    }


def test_kube_proxy_uses_nftables_and_leaves_the_machines_conntrack_settings_alone() -> None:
    config = yaml.safe_load(kubeproxy.render_config(Path("/k"), "node-a", "10.246.0.0/16", 1, 2))
    assert config["mode"] == "nftables" and config["clusterCIDR"] == "10.246.0.0/16"
    assert config["healthzBindAddress"].startswith("127.0.0.1:") and config["metricsBindAddress"].startswith("127.")
    # 0 means "don't set": kube-proxy would otherwise write the machine's conntrack sysctls
    assert config["conntrack"] == {
        "maxPerCore": 0,
        "min": 0,
        "tcpEstablishedTimeout": "0s",
        "tcpCloseWaitTimeout": "0s",
    }


def test_a_failed_run_keeps_its_logs_and_nothing_else(tmp_path: Path) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "node-a" / "pod-logs" / "default_shared-1" / "main").mkdir(parents=True)
    (run / "node-a" / "ctrd" / "root").mkdir(parents=True)
    outside.mkdir()
    (outside / "plugin").write_text("not the run's")
    for log in ("etcd.log", "node-a/pod-logs/default_shared-1/main/0.log"):
        (run / log).write_text("log")
    (run / "etcd").mkdir()
    (run / "etcd" / "db").write_text("data")
    (run / "node-a" / "ctrd" / "root" / "layer.tar").write_text("data")
    (run / "node-a" / "cri.sock").write_text("")
    (run / "node-a" / "ctrd" / "cni-bin").symlink_to(outside)
    keep_only_logs(run)
    kept = sorted(str(p.relative_to(run)) for p in run.rglob("*") if not p.is_dir())
    assert kept == ["etcd.log", "node-a/pod-logs/default_shared-1/main/0.log"]
    assert (outside / "plugin").read_text() == "not the run's"  # links are removed, never followed
    assert not (run / "etcd").exists() and not (run / "node-a" / "ctrd").exists()
