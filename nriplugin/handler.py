"""gpushare's NRI plugin decisions (:class:`~gpushare.nriplugin.session.PluginHandler`): the same decision
as the CRI shim's (:class:`gpushare.enforcement.decide.Enforcer`) at CreateContainer, answered as an
adjustment or a refusal; a GPU container's own memory limits at StartContainer, when its cgroup exists
and its process doesn't run yet; a pod's limits cleared when its sandbox ends; and at each session's
start, the running containers checked and the misplaced ones evicted (:mod:`gpushare.nriplugin.sync`).

Evicting: containerd 2.2 (NRI v0.11) acts on no eviction a plugin sends: ``SynchronizeResponse`` has no
field for them, the runtime side of ``UpdateContainers`` drops its ``evict`` list (pkg/adaptation/plugin.go),
and a ``CreateContainer`` answer's is merged away (tests/nri/test_nri_containerd.py shows both leave the
container running). Its own eviction of a container is a CRI StopContainer with no grace period
(``internal/cri/nri/nri_api_linux.go``, ``EvictContainer``),
so the plugin asks the runtime's CRI service for exactly that (``evict``), after Synchronize was answered:
the runtime holds its NRI lock until then, and stopping a container takes the same lock.

The decisions that wait on the API server or the driver run on threads, so the session's loop keeps
answering; the runtime sends one event at a time, so the sandbox table is only touched from the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence

from gpushare.nriplugin.edge import DeviceNode, adjustment, container_of, host_device
from gpushare.nriplugin.session import ContainerRefused, Runtime
from gpushare.nriplugin.sync import Running, ended_pods, evictions, live_containers, sandbox_states

from gpushare.enforcement.container import Target
from gpushare.enforcement.decide import Enforcer
from gpushare.enforcement.limits import SandboxState, limit_container, limit_running_pod, runs_elsewhere
from gpushare.pb import nri_pb2

log = logging.getLogger(__name__)

EVENT_EVICTED = "GPUContainerEvicted"
#: the events the plugin subscribes to
EVENTS = frozenset({nri_pb2.CREATE_CONTAINER, nri_pb2.STOP_POD_SANDBOX, nri_pb2.REMOVE_POD_SANDBOX})
#: and, where some card enforces memory limits, to the containers' starts
LIMIT_EVENTS = EVENTS | {nri_pb2.START_CONTAINER}

#: stops a container at once (container ID); raises when the runtime fails
Evict = Callable[[str], None]


class Handler:
    """See the module docstring. ``limiting``: some card enforces memory limits, so sandboxes' ends clear
    them. ``registered`` is true while a session is configured (the component's readiness)."""

    def __init__(
        self,
        enforcer: Enforcer,
        evict: Evict,
        limiting: bool,
        device_node: DeviceNode = host_device,
    ) -> None:
        self._enforcer = enforcer
        self._evict = evict
        self._limiting = limiting
        self._device_node = device_node
        self._sandboxes: dict[str, SandboxState] = {}
        self._audits: set[asyncio.Task[list[nri_pb2.ContainerEviction]]] = set()
        self.registered = False

    async def configure(self, request: nri_pb2.ConfigureRequest, runtime: Runtime) -> Collection[int]:
        self.registered = True
        return LIMIT_EVENTS if self._limiting else EVENTS

    async def synchronize(
        self, pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container]
    ) -> Sequence[nri_pb2.ContainerUpdate]:
        """Answered at once; the check runs after (see the module docstring)."""
        states = sandbox_states(pods, containers)
        self._sandboxes = {s.id: s for s in states}
        audit = asyncio.create_task(asyncio.to_thread(self.audit, list(pods), list(containers), states))
        self._audits.add(audit)
        audit.add_done_callback(self._audits.discard)
        return []

    async def audited(self) -> None:
        """Wait for the checks Synchronize started to end."""
        while self._audits:
            await asyncio.gather(*self._audits)

    def audit(
        self, pods: list[nri_pb2.PodSandbox], containers: list[nri_pb2.Container], states: list[SandboxState]
    ) -> list[nri_pb2.ContainerEviction]:
        """Set the running pods' limits again, clear the ended ones', evict the misplaced containers; the
        evictions asked for."""
        enforcer = self._enforcer
        cards = list(enforcer.cards())
        live = live_containers(pods, containers)
        unlimited: dict[str, str] = {}
        if self._limiting and enforcer.limiter is not None:
            limiter = enforcer.limiter
            with limiter.lock:
                for pod in ended_pods(pods, states):
                    limiter.clear(f"pod {pod.namespace}/{pod.name}", pod.linux.cgroup_parent, cards)
                ready = {state.pod_uid for state in states if state.ready}
                limiter.sweep((pod.linux.cgroup_parent for pod in pods), ready, cards)
            for pod in {pod.id: pod for pod, _ in live}.values():
                target = Target(pod.namespace, pod.name, pod.uid, "")
                cgroup = pod.linux.cgroup_parent
                _, why = limit_running_pod(
                    enforcer.resolver, limiter, target, dict(pod.annotations), lambda c=cgroup: c, cards
                )
                if why is not None:
                    unlimited[pod.uid] = why
                    log.error("running pod's memory limits not set: %s", why)
        running = []
        for pod, container in live:
            request = container_of(pod, container)
            resolution = enforcer.resolver.resolve(request, cards)
            if resolution.refusal is not None:
                log.error("running container left as it is: %s", resolution.refusal.message)
            elif self._limiting and enforcer.limiter is not None and pod.uid not in unlimited:
                refusal = limit_container(
                    enforcer.resolver,
                    enforcer.limiter,
                    resolution,
                    request.sandbox_annotations,
                    container.linux.cgroups_path,
                    cards,
                    make=False,
                )
                if refusal is not None:
                    unlimited[pod.uid] = refusal.message
                    log.error("running container's memory limits not set: %s", refusal.message)
            running.append(Running(container.id, request, resolution))
        found = evictions(running, unlimited, enforcer.options.block_unrequested_gpu)
        targets = {c.id: c.resolution.target for c in running}
        for eviction in found:
            log.warning("evicting container %s: %s", eviction.container_id, eviction.reason)
            if enforcer.events is not None:
                enforcer.events(targets[eviction.container_id], EVENT_EVICTED, eviction.reason, "Warning")
            try:
                self._evict(eviction.container_id)
            except Exception as exc:  # one container the runtime won't stop doesn't keep the others
                log.error("container %s not evicted: %s", eviction.container_id, exc)
        log.info("NRI synchronize: %d live container(s) checked, %d evicted", len(running), len(found))
        return found

    async def create_container(self, request: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        pod = request.pod
        self._sandboxes[pod.id] = SandboxState(pod.id, pod.uid, True)
        _, decision = await asyncio.to_thread(self._enforcer.decide, container_of(pod, request.container))
        if decision.refusal is not None:
            raise ContainerRefused(decision.refusal.message)
        if decision.edits is None:
            return nri_pb2.CreateContainerResponse()
        return nri_pb2.CreateContainerResponse(adjust=adjustment(decision.edits, self._device_node))

    async def start_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container) -> None:
        """Hold a GPU container to its share on its own cgroup before its process starts; refuse the start
        when that can't be done."""
        request = container_of(pod, container)
        refusal = await asyncio.to_thread(self._enforcer.start, request, container.linux.cgroups_path)
        if refusal is not None:
            raise ContainerRefused(refusal.message)

    async def stop_pod_sandbox(self, pod: nri_pb2.PodSandbox) -> None:
        """The runtime calls it once the sandbox's containers are stopped (containerd v2.2
        ``internal/cri/server/sandbox_stop.go``)."""
        self._sandboxes[pod.id] = SandboxState(pod.id, pod.uid, False)
        await self._end(pod)

    async def remove_pod_sandbox(self, pod: nri_pb2.PodSandbox) -> None:
        self._sandboxes.pop(pod.id, None)
        await self._end(pod)

    async def _end(self, pod: nri_pb2.PodSandbox) -> None:
        """Clear the pod's limits, unless it runs on in another sandbox."""
        limiter = self._enforcer.limiter
        if not self._limiting or limiter is None:
            return
        who = f"pod {pod.namespace}/{pod.name}"
        if runs_elsewhere(self._sandboxes.values(), pod.uid, pod.id):
            log.info("%s: sandbox %s ended; the pod runs on in another sandbox, limits kept", who, pod.id)
            return
        await asyncio.to_thread(limiter.clear, who, pod.linux.cgroup_parent, list(self._enforcer.cards()))

    async def shutdown(self) -> None:
        self.registered = False
