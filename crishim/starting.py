"""A GPU container's own memory limits, set as kubelet starts it (StartContainer), before its process can
run: on the cgroup its runtime spec names, its share of each card that enforces limits, soft 0
(:meth:`gpushare.memlimits.enforcer.PodLimiter.apply_container`).

Kubelet's call is held while the shim asks the runtime what the container is (ContainerStatus and its
sandbox's PodSandboxStatus, verbose) and sets the limits; then it goes on unchanged. The container's
cgroup doesn't exist yet: containerd makes the task, whose ``runc create`` makes the cgroup, inside
StartContainer itself (containerd 2.2 internal/cri/server/container_start.go, NewTask). So the shim
makes the directory first, and runc uses it as it is: its cgroup v2 manager creates each element of
the path only where it is missing (opencontainers/cgroups fs2/create.go, CreateCgroupPath: ``os.Mkdir``,
an existing directory is no error), and the limits set on it hold from the process's first allocation.

A limit that can't be set refuses the start (FAILED_PRECONDITION, naming pod, container and card):
kubelet reports it and recreates the container. A runtime that doesn't say what the container is
refuses it too (UNAVAILABLE): a GPU container never starts without its limits. A container the
runtime doesn't know is forwarded, for the runtime's own NOT_FOUND."""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError
from gpushare.crishim.edge import StatusError
from gpushare.crishim.metrics import REFUSALS
from gpushare.crishim.reconcile import container_status
from gpushare.crishim.splice import Forward, Refuse, Verdict, cri_paths

from gpushare.enforcement.decide import Enforcer
from gpushare.pb import cri_pb2, cri_pb2_grpc

log = logging.getLogger(__name__)

#: the call that starts a container; its request carries the container's id as field 1
CONTAINER_STARTS = cri_paths("StartContainer")


class ContainerStart:
    """Set the container's limits, then forward kubelet's StartContainer (see the module docstring).
    Keeps one channel to the runtime for the shim's lifetime (:meth:`close`): a start waits on two calls
    to it, not on a new connection too."""

    def __init__(self, runtime: str, enforcer: Enforcer) -> None:
        self.runtime = runtime
        self.enforcer = enforcer
        self._channel = grpc.insecure_channel(runtime)
        self._stub = cri_pb2_grpc.RuntimeServiceStub(self._channel)

    def __call__(self, request: bytes) -> Verdict:
        try:
            container = cri_pb2.StartContainerRequest.FromString(request).container_id
        except DecodeError:
            return Forward(request)  # the runtime answers it as it would without the shim
        try:
            started, cgroups_path = container_status(self._stub, container)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return Forward(request)
            return _unavailable(container, f"the runtime did not answer: {exc.details()}")
        except StatusError as exc:
            return _unavailable(container, f"the runtime did not say what it is: {exc}")
        refusal = self.enforcer.start(started, cgroups_path, make=True)
        if refusal is None:
            return Forward(request)
        REFUSALS.labels(refusal.reason).inc()
        return Refuse(grpc.StatusCode.FAILED_PRECONDITION, refusal.message)

    def close(self) -> None:
        self._channel.close()


def _unavailable(container: str, why: str) -> Refuse:
    message = f"container {container} not started: its GPU memory limits can't be set: {why}"
    log.error("refused StartContainer: %s", message)
    return Refuse(grpc.StatusCode.UNAVAILABLE, message)
