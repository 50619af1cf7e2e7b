"""A pod's GPU memory limits taken off its cgroup when its sandbox ends (StopPodSandbox,
RemovePodSandbox), rather than left for the driver to drop when kubelet removes the cgroup.

The limits may only go once nothing of the pod runs: a process of it left running without them could
allocate past its share. Kubelet's own call is therefore held while the shim asks the runtime to stop
the sandbox itself, clears the limits once the runtime answered OK, and only then forwards kubelet's
call unchanged: kubelet gets the runtime's own answer. The CRI (k8s.io/cri-api, ``api.proto``) makes
that safe: StopPodSandbox forcibly terminates the sandbox's running containers, "is idempotent, and
must not return an error if all relevant resources have already been reclaimed"; RemovePodSandbox
terminates them too, so stopping first changes nothing it would do. Nothing here refuses or delays a call beyond that
stop: a sandbox the runtime doesn't know, a stop that fails, or a limit the driver doesn't clear is
logged, naming pod and card, and the call goes on."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from gpushare.crishim.reconcile import CALL_TIMEOUT, sandbox_cgroup
from gpushare.crishim.splice import Forward, Verdict, cri_paths

from gpushare.cards import Card
from gpushare.contract.names import CRI_LABEL_POD_UID
from gpushare.enforcement.limits import SandboxState, runs_elsewhere
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.pb import cri_pb2, cri_pb2_grpc

log = logging.getLogger(__name__)

#: the calls that end a sandbox; both requests carry the sandbox's id as field 1
SANDBOX_ENDS = cri_paths("StopPodSandbox") | cri_paths("RemovePodSandbox")


@dataclass(frozen=True, slots=True)
class SandboxEnd:
    """Stop the sandbox, clear its pod's limits, forward kubelet's call (see the module docstring)."""

    runtime: str
    limiter: PodLimiter
    cards: Callable[[], Sequence[Card]]

    def __call__(self, request: bytes) -> Verdict:
        try:
            sandbox = cri_pb2.StopPodSandboxRequest.FromString(request).pod_sandbox_id
        except DecodeError:
            return Forward(request)  # the runtime answers it as it would without the shim
        try:
            self.end(sandbox)
        except grpc.RpcError as exc:
            log.error("sandbox %s: memory limits not cleared: the runtime: %s", sandbox, exc.details())
        except Exception:  # a bug here must not fail kubelet's call
            log.exception("sandbox %s: memory limits not cleared", sandbox)
        return Forward(request)

    def end(self, sandbox: str) -> None:
        """Stop ``sandbox`` and clear its pod's limits; raises grpc.RpcError when the runtime fails."""
        with grpc.insecure_channel(self.runtime) as channel:
            stub = cri_pb2_grpc.RuntimeServiceStub(channel)
            try:
                meta, cgroup = sandbox_cgroup(stub, sandbox)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return  # the runtime no longer knows it, nor so its cgroup
                raise
            who = f"pod {meta.namespace}/{meta.name}"
            stub.StopPodSandbox(cri_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox), timeout=CALL_TIMEOUT)
            # the lock from the look on: a sandbox of the pod turning ready meanwhile gets its limits after
            with self.limiter.lock:
                if _ready_sandbox(stub, meta.uid, sandbox):
                    log.info("%s: sandbox %s stopped; the pod runs on in another sandbox, limits kept", who, sandbox)
                    return
                self.limiter.clear(who, cgroup, list(self.cards()))


def _ready_sandbox(stub: cri_pb2_grpc.RuntimeServiceStub, uid: str, but: str) -> bool:
    """Whether the pod ``uid`` has a ready sandbox other than ``but`` (:func:`runs_elsewhere`)."""
    listed = stub.ListPodSandbox(
        cri_pb2.ListPodSandboxRequest(
            filter=cri_pb2.PodSandboxFilter(
                state=cri_pb2.PodSandboxStateValue(state=cri_pb2.SANDBOX_READY),
                label_selector={CRI_LABEL_POD_UID: uid},
            )
        ),
        timeout=CALL_TIMEOUT,
    ).items
    states = (SandboxState(s.id, s.metadata.uid, s.state == cri_pb2.SANDBOX_READY) for s in listed)
    return runs_elsewhere(states, uid, but)
