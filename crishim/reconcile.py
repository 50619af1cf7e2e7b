"""After a start (or a restart of the node agent), the GPU memory limits of the pods already running on
the node: each pod's cgroup gets them again from its assignment and its ResourceClaims, as if its
containers were being created now. A limit that can't be set can't refuse a running pod; it is logged
as an error naming the pod, card (or claim) and cause.

Then the limits a pod's end left behind while the agent was away: every sandbox the runtime still
knows that is stopped, of a pod with no ready sandbox, has the limits taken off its cgroup (while that
cgroup exists). NVML answers only per cgroup, with no list of the cgroups it limits, so a cgroup whose
sandbox the runtime no longer knows is not found here; the driver drops its limits when kubelet
removes it."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from gpushare.cards import Card
from gpushare.enforcement.container import Target
from gpushare.enforcement.limits import limit_running_pod
from gpushare.enforcement.resolve import Resolver
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.pb import cri_pb2, cri_pb2_grpc

log = logging.getLogger(__name__)

#: seconds to wait for the node's pod cache before reconciling from annotations alone
SYNC_WAIT = 60.0
SYNC_STEP = 0.5
CALL_TIMEOUT = 30.0


def cgroup_parent(sandbox_info: str) -> str:
    """The pod's cgroup as kubelet gave it to the sandbox, from containerd's verbose sandbox status."""
    try:
        config = json.loads(sandbox_info or "{}").get("config") or {}
    except ValueError:
        return ""
    return str((config.get("linux") or {}).get("cgroup_parent", ""))


def sandbox_cgroup(stub: cri_pb2_grpc.RuntimeServiceStub, sandbox: str) -> tuple[cri_pb2.PodSandboxMetadata, str]:
    """The sandbox's pod (its metadata) and the pod's cgroup, from the runtime's verbose status;
    grpc.RpcError when the runtime doesn't answer (NOT_FOUND: it no longer knows the sandbox)."""
    request = cri_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox, verbose=True)
    status = stub.PodSandboxStatus(request, timeout=CALL_TIMEOUT)
    return status.status.metadata, cgroup_parent(status.info.get("info", ""))


def cgroup_of(stub: cri_pb2_grpc.RuntimeServiceStub, sandbox: str) -> str:
    """The sandbox's pod cgroup (:func:`sandbox_cgroup`)."""
    return sandbox_cgroup(stub, sandbox)[1]


def reconcile_limits(
    runtime: str, resolver: Resolver, limiter: PodLimiter, cards: Callable[[], Sequence[Card]]
) -> tuple[int, int]:
    """Set the limits of every ready pod sandbox on the runtime, then clear those of the stopped ones
    (:func:`clear_stopped`); (pods limited, pods that failed)."""
    limited = failed = 0
    with grpc.insecure_channel(runtime) as channel:
        stub = cri_pb2_grpc.RuntimeServiceStub(channel)
        ready = cri_pb2.PodSandboxFilter(state=cri_pb2.PodSandboxStateValue(state=cri_pb2.SANDBOX_READY))
        sandboxes = stub.ListPodSandbox(cri_pb2.ListPodSandboxRequest(filter=ready), timeout=CALL_TIMEOUT).items
        clear_stopped(stub, limiter, list(cards()))
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


class Reconciler:
    """Runs :func:`reconcile_limits` once on a thread of its own, once the node's pod cache has synced
    (``wait_synced(timeout)``; at most :data:`SYNC_WAIT`, then from what the runtime and the
    annotations say); :meth:`stop` waits for it."""

    def __init__(self, run: Callable[[], tuple[int, int]], wait_synced: Callable[[float], bool] | None) -> None:
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
            limited, failed = self._run()
        except grpc.RpcError as exc:
            log.error("running pods' memory limits not reconciled: the runtime did not answer: %s", exc.details())
            return
        log.info("memory limits reconciled: %d running pod(s) limited, %d failed", limited, failed)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CALL_TIMEOUT)
