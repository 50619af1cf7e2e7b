"""The DevicePlugin gRPC service for one resource. Thin: the decision is :mod:`gpushare.deviceplugin.decision`,
the state around it :mod:`gpushare.deviceplugin.allocator`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from gpushare.deviceplugin.allocator import Allocator, Unavailable
from gpushare.deviceplugin.devices import device_list
from gpushare.deviceplugin.preferred import preferred_ids

from gpushare.assignment import Refusal
from gpushare.cards import Card
from gpushare.contract.units import MemoryUnit
from gpushare.pb import deviceplugin_pb2 as pb
from gpushare.pb import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DeviceState:
    """The node's cards plus a change counter that ListAndWatch streams wait on."""

    def __init__(self, cards: Callable[[], Sequence[Card]]) -> None:
        self._cards = cards
        self._changed = threading.Condition()
        self._version = 0
        self._closed = False

    def cards(self) -> Sequence[Card]:
        return self._cards()

    def bump(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_change(self, seen: int, timeout: float) -> tuple[int, bool]:
        """Block until the version moves past ``seen``; returns (version, closed)."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != seen or self._closed, timeout)
            return self._version, self._closed

    @property
    def version(self) -> int:
        return self._version


@dataclass(eq=False)
class ResourceService(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service for ``resource``. ``on_watch(True)`` when kubelet opens ListAndWatch,
    ``on_watch(False)`` when its stream ends other than by :meth:`stop` (kubelet went)."""

    resource: str
    state: DeviceState
    allocator: Allocator
    unit: MemoryUnit
    count_replicas: int = 0
    on_watch: Callable[[bool], None] = lambda _watching: None
    _stopping: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    def stop(self) -> None:
        self._stopping.set()

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        version = self.state.version
        self.on_watch(True)
        context.add_callback(lambda: None if self._stopping.is_set() else self.on_watch(False))
        yield device_list(self.resource, self.state.cards(), self.unit, self.count_replicas)
        while context.is_active() and not self._stopping.is_set():
            new_version, closed = self.state.wait_change(version, timeout=0.5)
            if closed:
                return
            if new_version != version:
                version = new_version
                log.info("%s: device health changed, re-sending the device list", self.resource)
                yield device_list(self.resource, self.state.cards(), self.unit, self.count_replicas)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for req in request.container_requests:
            chosen, rule = self.allocator.preferred(self.resource, req.allocation_size)
            ids = preferred_ids(
                self.resource,
                list(req.available_deviceIDs),
                list(req.must_include_deviceIDs),
                req.allocation_size,
                chosen,
                self.state.cards(),
                rule,
            )
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        responses = []
        for req in request.container_requests:
            try:
                decision = self.allocator.allocate(self.resource, list(req.devices_ids))
            except Refusal as refusal:
                code = (
                    grpc.StatusCode.INVALID_ARGUMENT if refusal.invalid_input else grpc.StatusCode.FAILED_PRECONDITION
                )
                context.abort(code, str(refusal))
            except Unavailable as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            responses.append(pb.ContainerAllocateResponse(envs=decision.envs, annotations=decision.annotations))
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
