"""The node agent's components survive what killed them in the field: kubelet wiping the
device-plugins directory while the plugin starts, and a component thread dying. Real gRPC over unix
sockets, the kubelet emulator, and the API stand-in through the official client."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from gpushare.deviceplugin import plugin as plugin_module
from gpushare.deviceplugin.plugin import SOCKETS, DevicePlugin
from gpushare.deviceplugin.wiring import start_device_plugin
from kubernetes import client
from podfactory import container, gpu_pod
from support.waiting import readiness, wait_until

from gpushare.contract.names import ENV_VISIBLE_DEVICES, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import GIB
from gpushare.gpus.backend import GpuBackend, InventoryError
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.kube.nodeapi import NodeApi
from gpushare.kube.retry import Backoff
from gpushare.kube.watch import WatchCache
from gpushare.node import NODE_API, components
from gpushare.observability import serve_http
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubeletemulator import KubeletEmulator
from gpushare.settings import MetricsEndpoint, NodeSettings
from gpushare.supervisor import Supervisor

SPEC = "2xA100-80GB:81920"


def settings(directory: Path) -> NodeSettings:
    return NodeSettings("n1", None, f"sim:{SPEC}", directory, GIB, frozenset())


def test_kubelet_wiping_the_directory_between_bind_and_chmod_leads_to_a_new_registration(
    kube_api: client.ApiClient, directory: Path, kubelet: KubeletEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    restrict = plugin_module._restrict
    wiped = []

    def kubelet_starts_in_between(path: Path) -> None:
        if not wiped:  # the first socket is bound; kubelet starts now and empties the directory
            wiped.append(path)
            kubelet.restart()
        restrict(path)

    monkeypatch.setattr(plugin_module, "_restrict", kubelet_starts_in_between)
    running = start_device_plugin(settings(directory), SimulatedBackend("n1", SPEC), kube_api)
    try:
        assert kubelet.wait_for(lambda k: k.capacity(RESOURCE_MEM) == 160 and k.capacity(RESOURCE_COUNT) > 0, 5), (
            "the plugin never registered after kubelet emptied its directory"
        )
        assert wiped == [directory / SOCKETS[RESOURCE_MEM]]
        assert running.plugin.wait_registered(5) and running.alive()
        assert all((directory / name).stat().st_mode & 0o777 == 0o600 for name in SOCKETS.values())
    finally:
        running.stop()


class FlakyBackend(SimulatedBackend):
    """Simulated cards whose reads fail once for one thread, as NVML can."""

    def __init__(self) -> None:
        super().__init__("n1", SPEC)
        self.fail_for: str | None = None

    def cards(self):  # type: ignore[no-untyped-def]
        if self.fail_for == threading.current_thread().name:
            self.fail_for = None
            raise InventoryError("NVML: driver not loaded")
        return super().cards()


def readyz(port: int) -> int:
    return readiness(f"http://127.0.0.1:{port}")


@contextmanager
def node_agent(directory: Path, backend: GpuBackend, shared: NodeApi) -> Iterator[tuple[Supervisor, int]]:
    """The node agent's components (no CRI shim) under a quick supervisor, and the port of its /readyz;
    ready on entry, stopped on exit."""
    supervisor = Supervisor(
        components(settings(directory), None, backend, shared, advertise_interval=0.1),
        backoff=Backoff(initial=0.5, maximum=1.0, jitter=0),
        interval=0.02,
    )
    supervisor.start()
    server = serve_http(MetricsEndpoint("127.0.0.1", 0), supervisor.ready)
    try:
        wait_until(lambda: readyz(server.port) == 200, 10, "the node agent to be ready")
        yield supervisor, server.port
    finally:
        server.stop()
        supervisor.stop()


@dataclass(frozen=True)
class Node:
    """Node n1 in the API stand-in, with its kubelet and device-plugins directory."""

    apiserver: ApiServer
    api: client.ApiClient
    core_v1: client.CoreV1Api
    directory: Path
    kubelet: KubeletEmulator


@pytest.fixture
def node(
    apiserver: ApiServer,
    kube_api: client.ApiClient,
    core_v1: client.CoreV1Api,
    directory: Path,
    kubelet: KubeletEmulator,
) -> Node:
    core_v1.create_node({"metadata": {"name": "n1"}})
    return Node(apiserver, kube_api, core_v1, directory, kubelet)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the deaths are the point
def test_a_component_that_dies_is_restarted_and_readyz_is_false_until_it_is_back(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = FlakyBackend()
    with node_agent(node.directory, backend, NodeApi(node.api, "n1")) as (supervisor, port):
        # the advertiser's card read fails with an error its loop doesn't expect: its thread dies
        backend.fail_for = "advertiser"
        wait_until(lambda: supervisor.down() == ["advertiser"], 5, "the advertiser's death to be noticed")
        assert readyz(port) == 503
        wait_until(lambda: readyz(port) == 200, 5, "the advertiser to be restarted")
        assert supervisor.restarts("advertiser") == 1

        # the device plugin's watchdog hits a bug once: its thread dies, and kubelet must get it back
        real = DevicePlugin._needs_restart
        failed = []

        def broken_once(self: DevicePlugin) -> bool:
            if not failed:
                failed.append(self)
                raise ValueError("unexpected")
            return real(self)

        monkeypatch.setattr(DevicePlugin, "_needs_restart", broken_once)
        wait_until(lambda: "device-plugin" in supervisor.down(), 5, "the device plugin's death to be noticed")
        assert readyz(port) == 503
        wait_until(lambda: readyz(port) == 200, 5, "the device plugin to be restarted")
        assert supervisor.restarts("device-plugin") == 1
        assert node.apiserver.reads["pods", "watch", "spec.nodeName=n1"] == 1, "the restart opened a watch of its own"
        assert node.kubelet.wait_for(lambda k: k.capacity(RESOURCE_MEM) == 160, 5)
        a1 = backend.cards()[1]
        node.core_v1.create_namespaced_pod("default", gpu_pod("after", [container("main", 4)], original_index=a1.minor))
        admission = node.kubelet.admit(
            node.core_v1.api_client.sanitize_for_serialization(node.core_v1.read_namespaced_pod("after", "default"))
        )
        assert admission.admitted, admission.error
        assert admission.containers["main"].envs[ENV_VISIBLE_DEVICES] == a1.uuid
        # the dead instances no longer hear of health changes: one subscriber per live component
        assert len(backend._subscribers._callbacks) == 2
    assert not any(node.directory.glob("gpushare-*.sock"))


class WatchKilled(BaseException):
    """What no ``except Exception`` catches: the watch's thread dies of it."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_pod_watch_that_dies_is_restarted_in_place_and_the_components_keep_it(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = NodeApi(node.api, "n1")
    with node_agent(node.directory, SimulatedBackend("n1", SPEC), shared) as (supervisor, port):
        cache = shared.pods
        assert cache is not None
        store = WatchCache._store

        def dies_on_the_next_event(self: WatchCache, type_: str, obj: dict) -> None:
            monkeypatch.setattr(WatchCache, "_store", store)
            raise WatchKilled

        monkeypatch.setattr(WatchCache, "_store", dies_on_the_next_event)
        node.core_v1.create_namespaced_pod("default", gpu_pod("missed", [container("main", 4)]))
        wait_until(lambda: supervisor.down() == [NODE_API], 5, "the watch's death to be noticed")
        assert readyz(port) == 503
        assert not cache.connected, "a dead watch must not pass for a live one"

        wait_until(lambda: readyz(port) == 200, 5, "the watch to be restarted")
        assert supervisor.restarts(NODE_API) == 1
        assert supervisor.restarts("device-plugin") == 0
        # the same cache, still the plugin's, learned on its new LIST what it missed
        assert shared.pods is cache
        wait_until(lambda: cache.get("missed", "default"), 5, "the missed pod in the cache")
        assert cache.connected
        watches = ("pods", "watch", "spec.nodeName=n1")
        wait_until(lambda: node.apiserver.reads[watches] == 2, 5, "the one watch to be opened again")
    assert not shared.alive()
