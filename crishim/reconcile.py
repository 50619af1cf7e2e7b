"""After a start (or a restart of the node agent), the GPU memory limits of the pods already running on
the node: each pod's cgroup gets them again from its assignment and its ResourceClaims, as if its
containers were being created now, and each running GPU container's own cgroup its own share, as if
it were starting now. A limit that can't be set can't refuse what already runs; it is logged as an
error naming the pod, container, card (or claim) and cause.

Then the limits a pod's end left behind while the agent was away: every sandbox the runtime still
knows that is stopped, of a pod with no ready sandbox, has the limits taken off its cgroup (while that
cgroup exists). NVML answers only per cgroup, with no list of the cgroups it limits, so the pod cgroups
whose sandboxes the runtime no longer knows are found by walking kubelet's pod hierarchy beside the
ones it does (:meth:`PodLimiter.sweep`): each of a pod with no ready sandbox, in which no process runs,
has its limits, and its children's, taken off.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from gpushare.crishim.edge import StatusError, cgroup_parent, started_container_of

from gpushare.cards import Card
from gpushare.enforcement.container import ContainerRequest, Target
from gpushare.enforcement.limits import limit_container, limit_running_pod
from gpushare.enforcement.resolve import Resolver
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.pb import cri_pb2, cri_pb2_grpc

log = logging.getLogger(__name__)

#: seconds to wait for the node's pod cache before reconciling from annotations alone
SYNC_WAIT = 60.0
SYNC_STEP = 0.5
CALL_TIMEOUT = 30.0


def sandbox_cgroup(stub: cri_pb2_grpc.RuntimeServiceStub, sandbox: str) -> tuple[cri_pb2.PodSandboxMetadata, str]:
    """The sandbox's pod (its metadata) and the pod's cgroup, from the runtime's verbose status;
    grpc.RpcError when the runtime doesn't answer (NOT_FOUND: it no longer knows the sandbox)."""
    status = _sandbox_status(stub, sandbox)
    return status.status.metadata, cgroup_parent(status.info.get("info", ""))


def cgroup_of(stub: cri_pb2_grpc.RuntimeServiceStub, sandbox: str) -> str:
    """The sandbox's pod cgroup (:func:`sandbox_cgroup`)."""
    return sandbox_cgroup(stub, sandbox)[1]


def container_status(
    stub: cri_pb2_grpc.RuntimeServiceStub,
    container: str,
    sandbox_status: Callable[[str], cri_pb2.PodSandboxStatusResponse] | None = None,
) -> tuple[ContainerRequest, str]:
    """The container as the decision reads it, and its cgroup, from the runtime's verbose statuses of
    it and of its sandbox (:func:`~gpushare.crishim.edge.started_container_of`; ``sandbox_status``:
    where a caller keeps the sandboxes it asked for). Raises grpc.RpcError when the runtime doesn't
    answer (NOT_FOUND: it doesn't know the container, or its sandbox), StatusError when its answer
    doesn't say."""
    request = cri_pb2.ContainerStatusRequest(container_id=container, verbose=True)
    status = stub.ContainerStatus(request, timeout=CALL_TIMEOUT)
    return started_container_of(status, sandbox_status or functools.partial(_sandbox_status, stub))


def _sandbox_status(stub: cri_pb2_grpc.RuntimeServiceStub, sandbox: str) -> cri_pb2.PodSandboxStatusResponse:
    request = cri_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox, verbose=True)
    return stub.PodSandboxStatus(request, timeout=CALL_TIMEOUT)


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What :func:`reconcile_limits` did."""

    pods: int = 0
    pods_failed: int = 0
    containers: int = 0
    containers_failed: int = 0
    #: pod cgroups found with limits but no ready sandbox, and cleared
    swept: int = 0

    def __str__(self) -> str:
        return (
            f"{self.pods} running pod(s) limited, {self.pods_failed} failed; "
            f"{self.containers} running GPU container(s) limited, {self.containers_failed} failed; "
            f"{self.swept} stale pod cgroup(s) cleared"
        )


def reconcile_limits(
    runtime: str, resolver: Resolver, limiter: PodLimiter, cards: Callable[[], Sequence[Card]]
) -> Reconciled:
    """Clear the limits of the pods that ended (:func:`clear_stopped`, :func:`sweep_ended`), then set
    those of every ready pod sandbox on the runtime and of its running GPU containers."""
    limited = failed = 0
    with grpc.insecure_channel(runtime) as channel:
        stub = cri_pb2_grpc.RuntimeServiceStub(channel)
        ready = cri_pb2.PodSandboxFilter(state=cri_pb2.PodSandboxStateValue(state=cri_pb2.SANDBOX_READY))
        sandboxes = stub.ListPodSandbox(cri_pb2.ListPodSandboxRequest(filter=ready), timeout=CALL_TIMEOUT).items
        clear_stopped(stub, limiter, list(cards()))
        swept = sweep_ended(stub, limiter, list(cards()))
        for sandbox in sandboxes:
            meta = sandbox.metadata
            target = Target(meta.namespace, meta.name, meta.uid, "")
            cgroup = functools.partial(cgroup_of, stub, sandbox.id)
            holds, why = limit_running_pod(resolver, limiter, target, sandbox.annotations, cgroup, list(cards()))
            if why is not None:
                failed += 1
                log.error("running pod's memory limits not set: %s", why)
            elif holds:
                limited += 1
        containers, containers_failed = limit_running_containers(stub, resolver, limiter, list(cards()))
    return Reconciled(limited, failed, containers, containers_failed, swept)


def limit_running_containers(
    stub: cri_pb2_grpc.RuntimeServiceStub, resolver: Resolver, limiter: PodLimiter, cards: Sequence[Card]
) -> tuple[int, int]:
    """Set each running GPU container's limits on its own cgroup, which exists (``make`` off): (GPU
    containers limited, failed). One the runtime no longer knows has ended meanwhile."""
    running = cri_pb2.ContainerFilter(state=cri_pb2.ContainerStateValue(state=cri_pb2.CONTAINER_RUNNING))
    listed = stub.ListContainers(cri_pb2.ListContainersRequest(filter=running), timeout=CALL_TIMEOUT).containers
    sandbox_status = functools.cache(functools.partial(_sandbox_status, stub))
    limited = failed = 0
    for container in listed:
        try:
            request, cgroups_path = container_status(stub, container.id, sandbox_status)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                continue
            raise
        except StatusError as exc:
            failed += 1
            log.error("running container %s: memory limits not set: %s", container.id, exc)
            continue
        resolution = resolver.resolve(request, cards)
        refusal = resolution.refusal or limit_container(
            resolver, limiter, resolution, request.sandbox_annotations, cgroups_path, cards, make=False
        )
        if refusal is not None:
            failed += 1
            log.error("running container's memory limits not set: %s", refusal.message)
        elif resolution.wants_gpu:
            limited += 1
    return limited, failed


def clear_stopped(stub: cri_pb2_grpc.RuntimeServiceStub, limiter: PodLimiter, cards: Sequence[Card]) -> int:
    """Clear the limits of each stopped sandbox's cgroup, for pods with no ready sandbox; how many were
    looked at. The limiter's lock is held from the listing on, so a pod whose sandbox turns ready
    meanwhile gets its limits (at CreateContainer) only after this clear, never before it."""
    looked = 0
    with limiter.lock:
        every = stub.ListPodSandbox(cri_pb2.ListPodSandboxRequest(), timeout=CALL_TIMEOUT).items
        running = {s.metadata.uid for s in every if s.state == cri_pb2.SANDBOX_READY}
        for sandbox in every:
            if sandbox.state == cri_pb2.SANDBOX_READY or sandbox.metadata.uid in running:
                continue
            _, cgroup = sandbox_cgroup(stub, sandbox.id)
            limiter.clear(f"pod {sandbox.metadata.namespace}/{sandbox.metadata.name}", cgroup, cards)
            looked += 1
    return looked


def sweep_ended(stub: cri_pb2_grpc.RuntimeServiceStub, limiter: PodLimiter, cards: Sequence[Card]) -> int:
    """Clear the limits of the pod cgroups beside those of the runtime's sandboxes whose pods have no
    ready sandbox and no process (:meth:`PodLimiter.sweep`); how many. The limiter's lock is held from
    the listing on, as in :func:`clear_stopped`."""
    with limiter.lock:
        every = stub.ListPodSandbox(cri_pb2.ListPodSandboxRequest(), timeout=CALL_TIMEOUT).items
        parents = []
        for sandbox in every:
            try:
                parents.append(cgroup_of(stub, sandbox.id))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # removed since listed: its cgroup goes with it
                    raise
        running = {s.metadata.uid for s in every if s.state == cri_pb2.SANDBOX_READY}
        cleared = limiter.sweep(parents, running, cards)
    log.info("memory limits cleared on %d stale pod cgroup(s) with no ready sandbox", len(cleared))
    return len(cleared)


class Reconciler:
    """Runs :func:`reconcile_limits` once on a thread of its own, once the node's pod cache has synced
    (``wait_synced(timeout)``; at most :data:`SYNC_WAIT`, then from what the runtime and the
    annotations say); :meth:`stop` waits for it."""

    def __init__(self, run: Callable[[], Reconciled], wait_synced: Callable[[float], bool] | None) -> None:
        self._run = run
        self._wait_synced = wait_synced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="cri-shim-limits", daemon=True)

    def start(self) -> Reconciler:
        self._thread.start()
        return self

    def _main(self) -> None:
        if self._wait_synced is not None:
            deadline = time.monotonic() + SYNC_WAIT
            while not self._wait_synced(SYNC_STEP):  # in steps, so that stop() isn't kept waiting
                if self._stop.is_set():
                    return
                if time.monotonic() >= deadline:
                    log.warning("the node's pods did not sync in %g s; memory limits from annotations", SYNC_WAIT)
                    break
        if self._stop.is_set():
            return
        try:
            done = self._run()
        except grpc.RpcError as exc:
            log.error("running pods' memory limits not reconciled: the runtime did not answer: %s", exc.details())
            return
        log.info("memory limits reconciled: %s", done)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CALL_TIMEOUT)
