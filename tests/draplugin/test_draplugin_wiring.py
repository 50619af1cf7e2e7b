"""The DRA plugin inside ``gpushare node --dra``: off by default, supervised like the other components."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from gpushare.draplugin.server import PluginPaths
from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.kube.nodeapi import NodeApi
from gpushare.kube.retry import Backoff
from gpushare.node import components
from gpushare.pb import pluginregistration_pb2 as reg_pb
from gpushare.pb import pluginregistration_pb2_grpc as reg_grpc
from gpushare.settings import NodeSettings
from gpushare.supervisor import Supervisor

SPEC = "2xA100-80GB:81920"


@pytest.fixture
def paths() -> Iterator[PluginPaths]:
    root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))  # short: unix socket paths
    yield PluginPaths(kubelet_root=root / "kubelet", cdi_dir=root / "cdi")
    shutil.rmtree(root, ignore_errors=True)


def node_components(paths: PluginPaths | None) -> list:
    # the device plugin is never started here: its directory is not used
    settings = NodeSettings("n1", None, f"sim:{SPEC}", Path("device-plugins"), GIB, frozenset())
    shared = NodeApi(client.ApiClient(), "n1", watch_pods=False)
    return components(settings, None, SimulatedBackend("n1", SPEC), shared, 0.1, paths)


def test_the_node_agent_serves_the_dra_plugin_only_when_asked(paths: PluginPaths) -> None:
    assert "dra-plugin" not in [c.name for c in node_components(None)]
    assert [c.name for c in node_components(paths)][-1] == "dra-plugin"


def test_the_plugin_is_ready_once_kubelet_registered_it_and_served_again_when_its_socket_goes(
    paths: PluginPaths,
) -> None:
    (dra,) = [c for c in node_components(paths) if c.name == "dra-plugin"]
    supervisor = Supervisor([dra], backoff=Backoff(initial=0.05, maximum=0.1, jitter=0), interval=0.02)
    supervisor.start()
    try:
        assert not supervisor.ready()
        with grpc.insecure_channel(f"unix://{paths.registration_socket}") as channel:
            reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
                reg_pb.RegistrationStatus(plugin_registered=True), timeout=5
            )
        assert supervisor.ready()
        paths.registration_socket.unlink()
        wait_until(lambda: supervisor.restarts("dra-plugin") == 1, 5, "the plugin to be restarted")
        wait_until(paths.registration_socket.is_socket, 5, "the registration socket to be served again")
        assert not supervisor.ready()  # kubelet must register the new socket
    finally:
        supervisor.stop()
    assert not paths.registration_socket.exists() and not paths.dra_socket.exists()
