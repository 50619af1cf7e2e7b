"""A kubelet emulator: kubelet's side of the device plugin protocol, for the sandbox and the tests.

It serves ``Registration`` on ``kubelet.sock``, rejects registrations kubelet would reject, follows each
plugin's ListAndWatch stream, and admits pods the way kubelet does (1.20 to 1.37 alike): per container (init containers
first, then in spec order), per resource in random order, one Allocate call with as many free healthy
device IDs as the limit, after asking GetPreferredAllocation when the plugin offers it. Results are
checkpointed: an admitted container is never allocated again. :meth:`restart` reproduces what a kubelet
restart does to the device-plugins directory.

With :meth:`follow` it also learns of its node's pods the way kubelet does, from its own watch on the API
server, and admits each one as soon as it is bound there. That watch is independent of the device
plugin's, which can be behind it: :class:`LaggingWatchCache` is a plugin informer that is, so the race
kubelet wins in a real cluster (Allocate for a pod the plugin's cache hasn't seen yet) happens here too.
"""

from __future__ import annotations

import logging
import queue
import random
import re
import stat
import threading
import time
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpushare.contract.errors import ContractError
from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.request import parse_pod_request, pod_key
from gpushare.kube.watch import WatchCache, node_pod_cache
from gpushare.pb import deviceplugin_pb2 as pb
from gpushare.pb import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("v1beta1",)
KUBELET_SOCKET = "kubelet.sock"
_EXTENDED_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def registration_error(request: pb.RegisterRequest) -> str | None:
    """Why kubelet would reject this registration, or None."""
    if request.version not in SUPPORTED_VERSIONS:
        return f"unsupported device plugin API version {request.version!r}"
    name = request.resource_name
    if not _EXTENDED_NAME.match(name):
        return f"resource name {name!r} is not an extended resource name (<domain>/<name>)"
    domain = name.split("/", 1)[0]
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return f"resource name {name!r} is in the reserved kubernetes.io domain"
    if "/" in request.endpoint:
        return f"endpoint {request.endpoint!r} must be a socket file name, not a path"
    return None


@dataclass
class ContainerResult:
    envs: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    devices: list[pb.DeviceSpec] = field(default_factory=list)
    #: device IDs kubelet handed to Allocate, per resource
    device_ids: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Checkpointed:
    device_ids: list[str]
    response: pb.ContainerAllocateResponse


@dataclass
class AdmissionResult:
    pod: str
    admitted: bool
    #: kubelet's UnexpectedAdmissionError message when not admitted
    error: str = ""
    containers: dict[str, ContainerResult] = field(default_factory=dict)
    uid: str = ""


@dataclass
class _Plugin:
    resource: str
    endpoint: str
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    options: pb.DevicePluginOptions
    devices: dict[str, str] = field(default_factory=dict)  # ID -> health
    #: ListAndWatch messages received so far
    updates: int = 0


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletEmulator) -> None:
        self._kubelet = kubelet

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        error = registration_error(request)
        if error:
            log.warning("kubelet: rejected registration of %s: %s", request.resource_name, error)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        try:
            self._kubelet._connect(request)
        except grpc.RpcError as exc:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot reach the plugin for {request.resource_name} at {request.endpoint}: {exc.details()}",
            )
        return pb.Empty()


class KubeletEmulator:
    def __init__(self, directory: str | Path, rng: random.Random | None = None) -> None:
        self.dir = Path(directory)
        #: orders one container's resources per admission; kubelet ranges over a Go map, so its order is random
        self._rng = rng or random.Random()
        self._server: grpc.Server | None = None
        self._plugins: dict[str, _Plugin] = {}
        self._changed = threading.Condition()
        #: (pod uid, container, resource) -> what Allocate gave, like kubelet's checkpoint
        self._checkpoint: dict[tuple[str, str, str], _Checkpointed] = {}
        self._admit_lock = threading.Lock()
        #: with :meth:`follow`: the admission of each pod seen bound to the node, by ``namespace/name``
        self.admissions: dict[str, AdmissionResult] = {}
        self._pods: WatchCache | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        socket = self.dir / KUBELET_SOCKET
        socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet"))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        self._server = server

    def follow(self, api: Any, node: str) -> None:
        """Watch the API server for pods bound to ``node`` and admit each new one at once, as kubelet's
        sync loop does; a deleted pod's devices are released. Results land in :attr:`admissions`."""
        self._pods = node_pod_cache(api, node)
        self._pods.add_listener(self._on_pod)
        self._pods.start()

    def _on_pod(self, type_: str, pod: dict[str, Any]) -> None:
        uid = (pod.get("metadata") or {}).get("uid", "")
        if type_ == "DELETED":
            self.release(uid)
            return
        key = pod_key(pod)
        known = self.admissions.get(key)
        if (known is None or known.uid != uid) and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            result = self.admit(pod)
            log.info("kubelet: pod %s %s", key, "admitted" if result.admitted else f"rejected: {result.error}")
            with self._changed:
                self.admissions[key] = result
                self._changed.notify_all()

    def stop(self) -> None:
        if self._pods is not None:
            self._pods.stop()
            self._pods = None
        if self._server is not None:
            self._server.stop(grace=0.2)
            self._server = None
        with self._changed:
            plugins, self._plugins = list(self._plugins.values()), {}
            self._changed.notify_all()
        for plugin in plugins:
            plugin.channel.close()

    def restart(self) -> None:
        """What a kubelet restart does: forget the plugins, delete every socket, create a new kubelet.sock.

        The checkpoint survives, as kubelet's does: admitted containers keep their devices.
        """
        self.stop()
        for entry in self.dir.iterdir():
            if stat.S_ISSOCK(entry.lstat().st_mode):
                entry.unlink(missing_ok=True)
        self.start()

    # --- plugins ------------------------------------------------------------------------------------------

    def _connect(self, request: pb.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix://{self.dir / request.endpoint}")
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        except grpc.RpcError:
            channel.close()
            raise
        plugin = _Plugin(request.resource_name, request.endpoint, channel, stub, options)
        with self._changed:
            old = self._plugins.get(request.resource_name)
            self._plugins[request.resource_name] = plugin
            self._changed.notify_all()
        if old is not None:
            old.channel.close()
        stream = stub.ListAndWatch(pb.Empty())
        threading.Thread(target=self._follow, args=(plugin, stream), name=f"lw-{plugin.resource}", daemon=True).start()
        log.info("kubelet: registered %s at %s", request.resource_name, request.endpoint)

    def _follow(self, plugin: _Plugin, stream: Any) -> None:
        try:
            for response in stream:
                with self._changed:
                    plugin.devices = {d.ID: d.health for d in response.devices}
                    plugin.updates += 1
                    self._changed.notify_all()
        except grpc.RpcError as exc:
            log.info("kubelet: ListAndWatch of %s ended: %s", plugin.resource, exc.code())

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        """Wait until ``predicate(self)`` holds; re-checked after every registration and device update."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    def registered(self, resource: str) -> bool:
        return resource in self._plugins

    def wait_registered(self, resource: str, timeout: float) -> bool:
        """Wait until ``resource`` is registered and its first device list has arrived."""
        return self.wait_for(lambda k: k.updates(resource) > 0, timeout)

    def updates(self, resource: str) -> int:
        plugin = self._plugins.get(resource)
        return plugin.updates if plugin else 0

    def devices(self, resource: str) -> dict[str, str]:
        plugin = self._plugins.get(resource)
        return dict(plugin.devices) if plugin else {}

    def capacity(self, resource: str) -> int:
        return len(self.devices(resource))

    def allocatable(self, resource: str) -> int:
        return sum(1 for health in self.devices(resource).values() if health == "Healthy")

    def plugin_options(self, resource: str) -> pb.DevicePluginOptions | None:
        plugin = self._plugins.get(resource)
        return plugin.options if plugin else None

    # --- admission ------------------------------------------------------------------------------------------

    def _in_use(self, resource: str) -> set[str]:
        return {d for (_, _, r), done in self._checkpoint.items() if r == resource for d in done.device_ids}

    def _pick(self, plugin: _Plugin, container: str, size: int) -> list[str]:
        in_use = self._in_use(plugin.resource)
        free = sorted(d for d, health in plugin.devices.items() if health == "Healthy" and d not in in_use)
        if len(free) < size:
            raise AdmissionError(
                f"container {container}: requested {size} {plugin.resource}, only {len(free)} healthy and unallocated"
            )
        if plugin.options.get_preferred_allocation_available:
            try:
                reply = plugin.stub.GetPreferredAllocation(
                    pb.PreferredAllocationRequest(
                        container_requests=[
                            pb.ContainerPreferredAllocationRequest(available_deviceIDs=free, allocation_size=size)
                        ]
                    ),
                    timeout=10,
                )
            except grpc.RpcError as exc:
                log.warning("kubelet: GetPreferredAllocation of %s failed: %s", plugin.resource, exc.details())
            else:
                preferred = list(reply.container_responses[0].deviceIDs) if reply.container_responses else []
                if len(set(preferred)) == size and set(preferred) <= set(free):
                    return preferred
        return free[:size]

    def admit(self, pod: Mapping[str, Any]) -> AdmissionResult:
        """Admit a bound pod: Allocate for every container and resource, init containers first.

        Containers already in the checkpoint get their recorded answer again without a new Allocate.
        """
        key = pod_key(pod)
        uid = (pod.get("metadata") or {}).get("uid", "")
        with self._admit_lock:
            result = AdmissionResult(pod=key, admitted=True, uid=uid)
            try:
                for container in parse_pod_request(pod).gpu_containers:
                    outcome = result.containers.setdefault(container.name, ContainerResult())
                    for resource, size in self._resource_order(container.mem, container.count):
                        done = self._allocated(uid, container.name, resource, size)
                        outcome.device_ids[resource] = done.device_ids
                        outcome.envs.update(done.response.envs)
                        outcome.annotations.update(done.response.annotations)
                        outcome.devices.extend(done.response.devices)
            except (AdmissionError, ContractError) as exc:
                result = AdmissionResult(
                    pod=key, admitted=False, error=f"UnexpectedAdmissionError: pod {key}: {exc}", uid=uid
                )
                log.warning("kubelet: %s", result.error)
            return result

    def _resource_order(self, mem: int, count: int) -> list[tuple[str, int]]:
        """The container's device-plugin resources in the order kubelet (1.20 to 1.37) calls Allocate for them: it
        ranges over the container's limits, a Go map, so gpu-mem and gpu-count come in either order."""
        wanted = [(r, n) for r, n in ((RESOURCE_MEM, mem), (RESOURCE_COUNT, count)) if n]
        self._rng.shuffle(wanted)
        return wanted

    def _allocated(self, uid: str, container: str, resource: str, size: int) -> _Checkpointed:
        checkpoint_key = (uid, container, resource)
        if checkpoint_key in self._checkpoint:
            return self._checkpoint[checkpoint_key]
        plugin = self._plugins.get(resource)
        if plugin is None:
            raise AdmissionError(f"container {container}: no device plugin registered for {resource}")
        ids = self._pick(plugin, container, size)
        try:
            reply = plugin.stub.Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=10
            )
        except grpc.RpcError as exc:
            raise AdmissionError(
                f"container {container}: Allocate {resource} failed ({exc.code().name}): {exc.details()}"
            ) from None
        if len(reply.container_responses) != 1:
            raise AdmissionError(
                f"container {container}: Allocate {resource} answered {len(reply.container_responses)} "
                "container responses for one request"
            )
        done = _Checkpointed(ids, reply.container_responses[0])
        self._checkpoint[checkpoint_key] = done
        return done

    def allocations(self, resource: str) -> dict[tuple[str, str], list[str]]:
        """(pod uid, container) -> device IDs currently held, from the checkpoint."""
        return {(uid, ctr): done.device_ids for (uid, ctr, r), done in self._checkpoint.items() if r == resource}

    def release(self, pod_uid: str) -> None:
        """The pod finished: its devices are free again."""
        with self._admit_lock:
            for key in [k for k in self._checkpoint if k[0] == pod_uid]:
                del self._checkpoint[key]


class AdmissionError(Exception):
    """The pod can't be admitted; kubelet reports it as UnexpectedAdmissionError."""


class LaggingWatchCache(WatchCache):
    """A device plugin's pod informer whose watch delivers every change ``lag`` seconds late, in order.
    What the plugin writes or re-reads itself (:meth:`apply`) is recorded at once, as in the real one."""

    def __init__(self, api: Any, node: str, lag: float) -> None:
        super().__init__(api, "pods", field_selector=f"spec.nodeName={node}")
        self.lag = lag
        self._late: queue.Queue[tuple[float, str, dict[str, Any]]] = queue.Queue()
        threading.Thread(target=self._deliver, name="lagging-watch", daemon=True).start()

    def apply(self, obj: dict[str, Any]) -> None:
        WatchCache._store(self, "MODIFIED", obj)

    def _store(self, type_: str, obj: dict[str, Any]) -> None:
        self._late.put((time.monotonic() + self.lag, type_, obj))

    def _deliver(self) -> None:
        while not self._stop.is_set():
            try:
                due, type_, obj = self._late.get(timeout=0.1)
            except queue.Empty:
                continue
            if not self._stop.wait(max(0.0, due - time.monotonic())):
                WatchCache._store(self, type_, obj)
