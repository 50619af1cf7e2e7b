"""What clusters on one machine can't share: a second cluster is refused, naming the first, before it
changes anything on the host, and a cluster that fails half-way through making its network removes
what it made. The host is faked (``ip`` as a set of links), so these run anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.sandbox import hostlease, kubeproxy, podnetwork
from gpushare.sandbox.launch import ClusterError
from gpushare.sandbox.podnetwork import ROUTED_LEASE, routed_link
from gpushare.sandbox.shippedcluster import ShippedCluster

NODES = [("node-a", "dgx-a100")]


class FakeHost:
    """``ip`` as the links it made; ``route add`` answers as when another link holds the route."""

    def __init__(self) -> None:
        self.links: set[str] = set()
        self.commands: list[str] = []

    def ip(self, *args: str) -> None:
        self.commands.append(" ".join(args))
        if args[:2] == ("link", "add"):
            self.links.add(args[2])
        if args[:2] == ("route", "add"):
            raise ClusterError(f"ip {' '.join(args)}: RTNETLINK answers: File exists")

    def remove_bridge(self, bridge: str) -> None:
        self.links.discard(bridge)


@pytest.fixture
def host(directory: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHost:
    fake = FakeHost()
    monkeypatch.setattr(podnetwork, "_ip", fake.ip)
    monkeypatch.setattr(podnetwork, "remove_bridge", fake.remove_bridge)
    monkeypatch.setattr("gpushare.sandbox.shippedcluster.remove_bridge", fake.remove_bridge)
    monkeypatch.setattr(kubeproxy, "check_free", lambda: None)
    monkeypatch.setattr(kubeproxy, "remove_tables", lambda: None)
    monkeypatch.setattr(hostlease, "LEASE_DIR", directory / "leases")
    return fake


def hold_in_child(name: str, workdir: Path, leases: Path) -> subprocess.Popen[str]:
    """A process holding lease ``name`` for ``workdir`` until its stdin closes (or it is killed)."""
    code = (
        "import sys; from pathlib import Path; from gpushare.sandbox import hostlease\n"
        f"assert hostlease.try_claim({name!r}, Path({str(workdir)!r}), Path({str(leases)!r}))\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def test_a_second_routed_cluster_is_refused_naming_the_first_before_touching_the_host(
    host: FakeHost, directory: Path
) -> None:
    first = hold_in_child(ROUTED_LEASE, Path("/tmp/gs-first"), directory / "leases")
    try:
        with pytest.raises(ClusterError) as refused:
            ShippedCluster(NODES, directory / "second").start()
    finally:
        first.kill()
        first.wait()
    assert "routed network (10.243.0.1" in str(refused.value)
    assert f"the cluster in /tmp/gs-first (pid {first.pid})" in str(refused.value)
    assert host.commands == []


def test_a_routed_network_that_fails_half_way_is_removed(host: FakeHost, directory: Path) -> None:
    with pytest.raises(ClusterError, match="File exists"):
        ShippedCluster(NODES, directory / "cluster").start()
    assert "link add " + routed_link(directory / "cluster") + " type bridge" in host.commands
    assert host.links == set()
    # and its lease is free again
    lease = hostlease.try_claim(ROUTED_LEASE, directory / "next")
    assert lease is not None
    lease.release()


def test_the_next_cluster_removes_what_a_killed_one_left(host: FakeHost, directory: Path) -> None:
    killed = hold_in_child(ROUTED_LEASE, directory / "killed", directory / "leases")
    killed.kill()
    killed.wait()
    host.links.add(routed_link(directory / "killed"))  # its link, with the Service route
    with pytest.raises(ClusterError, match="File exists"):  # this host's route add always fails
        ShippedCluster(NODES, directory / "cluster").start()
    assert host.links == set()


def test_leases_free_when_their_holder_exits_and_slots_go_to_the_first_free(tmp_path: Path) -> None:
    holder = hold_in_child("block-0", tmp_path / "one", tmp_path)
    try:
        slot, lease = hostlease.claim_first_free("block", 2, tmp_path / "two", "blocks", tmp_path)
        assert slot == 1
        with pytest.raises(ClusterError, match=f"all 2 blocks are in use.*{tmp_path}"):
            hostlease.claim_first_free("block", 2, tmp_path / "three", "blocks", tmp_path)
        with pytest.raises(ClusterError, match=f"the cluster in {tmp_path / 'two'} \\(pid {os.getpid()}\\)"):
            hostlease.claim("block-1", tmp_path / "three", "block 1", tmp_path)
        lease.release()
    finally:
        holder.kill()
        holder.wait()
    slot, lease = hostlease.claim_first_free("block", 2, tmp_path / "three", "blocks", tmp_path)
    assert (slot, lease.previous) == (0, tmp_path / "one")
    lease.release()
