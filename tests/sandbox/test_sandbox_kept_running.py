"""``gpushare sandbox --keep-running`` on the real cluster, as a user goes on with it: their own pods,
without hostNetwork, run on the node's pod network, and each component's endpoints are printed."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.sandboxrun import SandboxRun, kept_running, kubeconfig
from support.waiting import wait_until

from gpushare.kube.objects import list_pods
from gpushare.kube.transport import load_api
from gpushare.sandbox import binaries
from gpushare.sandbox.nodespec import DEFAULT_NODES, parse_node
from gpushare.sandbox.podnetwork import pod_subnet
from gpushare.sandbox.realcluster import realcluster_available

pytestmark = pytest.mark.skipif(
    realcluster_available() is not None, reason=f"no real cluster here: {realcluster_available()}"
)
REPO = Path(__file__).resolve().parents[2]
GANG = REPO / "deploy" / "examples" / "gang" / "train-4.yaml"
SUBNETS = {parse_node(text).name: ipaddress.ip_network(pod_subnet(i)) for i, text in enumerate(DEFAULT_NODES)}


@pytest.fixture(scope="module")
def kept() -> Iterator[SandboxRun]:
    with kept_running() as run:
        yield run


def endpoints(run: SandboxRun) -> dict[str, str]:
    """The Endpoints table: component -> the rest of its line."""
    table = run.out.text.split("\nEndpoints\n\n", 1)[1].split("\n\n", 1)[0]
    rows = [re.split(r"\s{2,}", line, maxsplit=1) for line in table.splitlines()[1:]]
    return {name: where for name, where in rows}


def test_a_users_pods_without_host_network_run_with_an_address_in_their_nodes_subnet(kept: SandboxRun) -> None:
    config = kubeconfig(kept)
    subprocess.run(
        [str(binaries.built("kubectl")), "--kubeconfig", config, "apply", "-f", str(GANG)],
        check=True,
        capture_output=True,
    )
    api = load_api(config)

    def all_running() -> list[dict] | None:
        pods = list_pods(api)
        gang = [p for p in pods if p["metadata"]["name"].startswith("train-4-")]
        if len(gang) == 4 and all((p.get("status") or {}).get("phase") == "Running" for p in gang):
            return pods
        return None

    pods = wait_until(all_running, 120, "the 4 members of gang train-4 to run", 0.5)
    running = [p for p in pods if p["status"].get("phase") == "Running"]
    assert not [p["metadata"]["name"] for p in running if p["spec"].get("hostNetwork")]
    nodes_used = set()
    for pod in running:
        node, ip = pod["spec"]["nodeName"], ipaddress.ip_address(pod["status"]["podIP"])
        assert ip in SUBNETS[node], f"{pod['metadata']['name']} on {node} has {ip}, not in {SUBNETS[node]}"
        nodes_used.add(node)
    assert nodes_used == set(SUBNETS)  # each node's own subnet, both in use by the examples


def test_each_components_endpoints_are_printed_and_answer(kept: SandboxRun) -> None:
    found = endpoints(kept)
    expected = {"kube-apiserver", "extender for default-scheduler"} | {f"node agent {n}" for n in SUBNETS}
    assert set(found) == expected, found
    for name, where in found.items():
        if name == "kube-apiserver":
            assert f"kubectl --kubeconfig {kubeconfig(kept)}" in where
            continue
        (health,) = re.findall(r"(http://127\.0\.0\.1:\d+)/metrics", where)
        with urllib.request.urlopen(f"{health}/healthz", timeout=10) as reply:
            assert reply.status == 200, name


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(words)))
    return found


def test_health_and_metrics_listen_on_loopback_only(kept: SandboxRun) -> None:
    for name, where in endpoints(kept).items():
        for port in re.findall(r"127\.0\.0\.1:(\d+)", where):
            assert listening_addresses(int(port)) == {"127.0.0.1"}, f"{name} port {port}"
