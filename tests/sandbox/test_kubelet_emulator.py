"""The kubelet emulator against a scripted device plugin: registration checks, device lists,
admission (preferred allocation, one request per call, checkpoint) and restarts."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from podfactory import container, gpu_pod

from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM
from gpushare.pb import deviceplugin_pb2 as pb
from gpushare.pb import deviceplugin_pb2_grpc as pb_grpc
from gpushare.sandbox.cluster import devices_listed
from gpushare.sandbox.kubeletemulator import KUBELET_SOCKET, KubeletEmulator, registration_error

ENDPOINT = "scripted.sock"


class ScriptedPlugin(pb_grpc.DevicePluginServicer):
    """Serves a fixed device list for one resource and records what kubelet asks."""

    def __init__(
        self,
        directory: Path,
        device_ids: list[str],
        *,
        preferred: list[str] | None = None,
        endpoint: str = ENDPOINT,
        calls: list[str] | None = None,
    ) -> None:
        self.dir = directory
        self.endpoint = endpoint
        #: a log shared between plugins: the endpoint of each Allocate, in the order kubelet called them
        self.calls = calls if calls is not None else []
        self.lists: queue.Queue[list[pb.Device] | None] = queue.Queue()
        self.lists.put([pb.Device(ID=d, health="Healthy") for d in device_ids])
        self.preferred = preferred
        self.allocations: list[list[list[str]]] = []
        self.preference_requests = 0
        self.refuse: str | None = None
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{directory / endpoint}")
        self.server.start()

    def register(self, resource: str = RESOURCE_MEM, version: str = "v1beta1", endpoint: str | None = None) -> None:
        with grpc.insecure_channel(f"unix://{self.dir / KUBELET_SOCKET}") as channel:
            pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(version=version, endpoint=endpoint or self.endpoint, resource_name=resource),
                timeout=5,
            )

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(get_preferred_allocation_available=self.preferred is not None)

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        while context.is_active():
            try:
                devices = self.lists.get(timeout=0.1)
            except queue.Empty:
                continue
            if devices is None:
                return
            yield pb.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        self.preference_requests += 1
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=self.preferred or [])]
        )

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        with self._lock:
            self.allocations.append([list(r.devices_ids) for r in request.container_requests])
            self.calls.append(self.endpoint)
            number = len(self.allocations)
        if self.refuse:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse)
        return pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(
                    envs={"CALL": str(number)},
                    annotations={"ids": ",".join(r.devices_ids)},
                    devices=[pb.DeviceSpec(container_path="/dev/x", host_path="/dev/x", permissions="rw")],
                )
                for r in request.container_requests
            ]
        )


def plugin_with(directory: Path, count: int, **kwargs: object) -> ScriptedPlugin:
    return ScriptedPlugin(directory, [f"d{i}" for i in range(count)], **kwargs)


@pytest.fixture
def plugin(directory: Path, kubelet: KubeletEmulator) -> Iterator[ScriptedPlugin]:
    scripted = plugin_with(directory, 6)
    scripted.register()
    assert kubelet.wait_registered(RESOURCE_MEM, 5)
    yield scripted
    scripted.lists.put(None)
    scripted.server.stop(grace=0)


@pytest.mark.parametrize(
    ("version", "resource", "endpoint", "reason"),
    [
        ("v1alpha", RESOURCE_MEM, ENDPOINT, "unsupported device plugin API version 'v1alpha'"),
        ("v1beta1", "gpu-mem", ENDPOINT, "not an extended resource name"),
        ("v1beta1", "kubernetes.io/gpu", ENDPOINT, "reserved kubernetes.io domain"),
        ("v1beta1", "storage.kubernetes.io/gpu", ENDPOINT, "reserved kubernetes.io domain"),
        ("v1beta1", RESOURCE_MEM, "/tmp/x.sock", "must be a socket file name"),
    ],
)
def test_registrations_kubelet_would_reject_are_rejected(
    directory: Path, kubelet: KubeletEmulator, version: str, resource: str, endpoint: str, reason: str
) -> None:
    assert reason in registration_error(pb.RegisterRequest(version=version, endpoint=endpoint, resource_name=resource))
    scripted = plugin_with(directory, 1)
    try:
        with pytest.raises(grpc.RpcError) as error:
            scripted.register(resource, version, endpoint)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in error.value.details()
        assert not kubelet.registered(resource)
    finally:
        scripted.server.stop(grace=0)


def test_a_registration_whose_endpoint_is_not_served_fails(directory: Path, kubelet: KubeletEmulator) -> None:
    with grpc.insecure_channel(f"unix://{directory / KUBELET_SOCKET}") as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.RegistrationStub(channel).Register(
            pb.RegisterRequest(version="v1beta1", endpoint="nobody.sock", resource_name=RESOURCE_MEM), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "nobody.sock" in err.value.details()
    assert not kubelet.registered(RESOURCE_MEM)


def test_each_device_list_replaces_the_last_and_allocatable_counts_healthy_devices(
    kubelet: KubeletEmulator, plugin: ScriptedPlugin
) -> None:
    assert kubelet.capacity(RESOURCE_MEM) == 6 and kubelet.allocatable(RESOURCE_MEM) == 6
    plugin.lists.put([pb.Device(ID="d0", health="Healthy"), pb.Device(ID="d1", health="Unhealthy")])
    assert kubelet.wait_for(lambda k: k.capacity(RESOURCE_MEM) == 2, 5)
    assert kubelet.allocatable(RESOURCE_MEM) == 1
    assert kubelet.devices(RESOURCE_MEM) == {"d0": "Healthy", "d1": "Unhealthy"}
    assert kubelet.updates(RESOURCE_MEM) == 2


def test_admission_calls_allocate_once_per_container_with_one_request_init_first(
    kubelet: KubeletEmulator, plugin: ScriptedPlugin
) -> None:
    pod = gpu_pod("p", [container("main", 2), container("plain")], init=[container("setup", 1)], uid="u1")
    result = kubelet.admit(pod)
    assert result.admitted, result.error
    assert [len(call) for call in plugin.allocations] == [1, 1]  # one ContainerAllocateRequest per call
    assert [len(call[0]) for call in plugin.allocations] == [1, 2]  # init container first, then "main"
    assert result.containers["setup"].envs == {"CALL": "1"} and result.containers["main"].envs == {"CALL": "2"}
    assert result.containers["main"].annotations == {"ids": ",".join(plugin.allocations[1][0])}
    assert result.containers["main"].devices[0].host_path == "/dev/x"
    assert "plain" not in result.containers
    # the two containers never share a device
    assert not set(plugin.allocations[0][0]) & set(plugin.allocations[1][0])


def test_one_containers_resources_are_allocated_in_either_order_as_kubelet_ranges_over_a_map(
    directory: Path,
) -> None:
    # kubelet 1.20 (devicemanager allocateContainerResources) loops over container.Resources.Limits, a Go
    # map: gpu-mem and gpu-count of one container reach their plugins in no fixed order
    emulator = KubeletEmulator(directory, rng=random.Random(7))
    emulator.start()
    calls: list[str] = []
    plugins = [plugin_with(directory, 16, endpoint="mem.sock", calls=calls),
               plugin_with(directory, 16, endpoint="count.sock", calls=calls)]  # fmt: skip
    try:
        plugins[0].register(RESOURCE_MEM)
        plugins[1].register(RESOURCE_COUNT)
        assert emulator.wait_registered(RESOURCE_COUNT, 5)
        firsts = set()
        for i in range(8):
            calls.clear()
            assert emulator.admit(gpu_pod(f"p{i}", [container("main", 2, 2)], uid=f"u{i}")).admitted
            assert sorted(calls) == ["count.sock", "mem.sock"]
            firsts.add(calls[0])
            emulator.release(f"u{i}")
        assert firsts == {"count.sock", "mem.sock"}
    finally:
        emulator.stop()
        for scripted in plugins:
            scripted.lists.put(None)
            scripted.server.stop(grace=0)


def test_admitted_containers_are_never_allocated_again(kubelet: KubeletEmulator, plugin: ScriptedPlugin) -> None:
    pod = gpu_pod("p", [container("main", 2)], uid="u1")
    first = kubelet.admit(pod)
    again = kubelet.admit(pod)
    assert len(plugin.allocations) == 1
    assert again.containers["main"].envs == first.containers["main"].envs
    assert again.containers["main"].device_ids == first.containers["main"].device_ids


def test_devices_held_by_a_pod_are_free_again_after_release(kubelet: KubeletEmulator, plugin: ScriptedPlugin) -> None:
    assert kubelet.admit(gpu_pod("a", [container("main", 4)], uid="a")).admitted
    crowded = kubelet.admit(gpu_pod("b", [container("main", 4)], uid="b"))
    assert not crowded.admitted and "only 2 healthy and unallocated" in crowded.error
    assert len(plugin.allocations) == 1
    kubelet.release("a")
    assert kubelet.admit(gpu_pod("b", [container("main", 4)], uid="b")).admitted


def test_an_allocate_error_rejects_the_pod_naming_the_error(kubelet: KubeletEmulator, plugin: ScriptedPlugin) -> None:
    plugin.refuse = "card 3 is on fire"
    result = kubelet.admit(gpu_pod("p", [container("main", 1)], uid="u1"))
    assert not result.admitted
    assert result.error.startswith("UnexpectedAdmissionError: pod default/p: container main")
    assert "(FAILED_PRECONDITION): card 3 is on fire" in result.error
    plugin.refuse = None
    assert kubelet.admit(gpu_pod("p", [container("main", 1)], uid="u1")).admitted  # nothing was checkpointed


def test_a_resource_without_a_plugin_rejects_the_pod(kubelet: KubeletEmulator, plugin: ScriptedPlugin) -> None:
    result = kubelet.admit(gpu_pod("p", [container("main", count=1)], uid="u1"))
    assert not result.admitted and f"no device plugin registered for {RESOURCE_COUNT}" in result.error


def test_a_usable_preferred_allocation_is_followed(directory: Path, kubelet: KubeletEmulator) -> None:
    scripted = plugin_with(directory, 6, preferred=["d4", "d5"])
    try:
        scripted.register()
        assert kubelet.wait_registered(RESOURCE_MEM, 5)
        assert kubelet.admit(gpu_pod("p", [container("main", 2)], uid="u1")).admitted
        assert scripted.preference_requests == 1 and scripted.allocations == [[["d4", "d5"]]]
        # d4 and d5 are taken now: the same preference no longer fits, so kubelet picks by itself
        assert kubelet.admit(gpu_pod("q", [container("main", 2)], uid="u2")).admitted
        assert scripted.allocations[1] == [["d0", "d1"]]
    finally:
        scripted.server.stop(grace=0)


def test_no_preference_is_asked_when_the_plugin_does_not_offer_it(
    kubelet: KubeletEmulator, plugin: ScriptedPlugin
) -> None:
    assert kubelet.admit(gpu_pod("p", [container("main", 2)], uid="u1")).admitted
    assert plugin.preference_requests == 0


def test_restart_deletes_every_socket_and_creates_a_new_kubelet_socket(
    directory: Path, kubelet: KubeletEmulator, plugin: ScriptedPlugin
) -> None:
    assert kubelet.admit(gpu_pod("p", [container("main", 2)], uid="u1")).admitted
    (directory / "notes.txt").write_text("not a socket")
    kubelet.restart()
    assert not (directory / ENDPOINT).exists() and (directory / "notes.txt").exists()
    assert not kubelet.registered(RESOURCE_MEM) and kubelet.capacity(RESOURCE_MEM) == 0
    # the checkpoint outlives the restart, as kubelet's does
    assert kubelet.allocations(RESOURCE_MEM) == {("u1", "main"): plugin.allocations[0][0]}
    # the new kubelet.sock takes registrations from a plugin serving again
    again = plugin_with(directory, 3)
    try:
        again.register()
        assert kubelet.wait_registered(RESOURCE_MEM, 5) and kubelet.capacity(RESOURCE_MEM) == 3
    finally:
        again.server.stop(grace=0)


def test_the_sandbox_waits_for_both_device_lists_not_just_the_registrations(
    plugin: ScriptedPlugin, kubelet: KubeletEmulator, directory: Path
) -> None:
    """A node published before gpu-count's first list shows gpu-count 0."""
    replicas = ScriptedPlugin(directory, [], endpoint="replicas.sock")
    replicas.lists.get_nowait()  # hold the first list back
    try:
        replicas.register(RESOURCE_COUNT)
        assert kubelet.wait_for(lambda k: k.registered(RESOURCE_COUNT), 5)
        assert kubelet.capacity(RESOURCE_MEM) == 6 and kubelet.capacity(RESOURCE_COUNT) == 0
        assert not devices_listed(kubelet)
        replicas.lists.put([pb.Device(ID="r0", health="Healthy")])
        assert kubelet.wait_for(devices_listed, 5)
        assert kubelet.capacity(RESOURCE_COUNT) == 1
    finally:
        replicas.lists.put(None)
        replicas.server.stop(grace=0)
