"""What the NRI plugin makes of the runtime's pods and containers when a session starts (Synchronize):
containers created while it was away went through no decision, so each one still running is checked
against its assignment, and one that sees what it must not is evicted; kubelet then creates it again,
through the plugin. Pure: the caller resolves the containers and sets the pods' limits.

Evicted are, on positive evidence only (a container whose assignment can't be read now, the API server
being away say, is left running and logged): a container with GPUs that sees other cards (or other
claims' cards) than it was assigned, one with GPUs whose pod's memory limits can't be set, and one
without GPUs that sees a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpushare.assignment import describe
from gpushare.contract.names import ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID
from gpushare.enforcement.container import ContainerRequest
from gpushare.enforcement.limits import SandboxState
from gpushare.enforcement.resolve import Resolution
from gpushare.pb import nri_pb2

#: the states of a container that may still run (or start) with what it was given
LIVE = frozenset({nri_pb2.CONTAINER_CREATED, nri_pb2.CONTAINER_RUNNING, nri_pb2.CONTAINER_PAUSED})
#: NVIDIA_VISIBLE_DEVICES values under which the NVIDIA runtime exposes no card ("none": the driver's
#: libraries only)
NO_CARD = frozenset({"", VISIBLE_DEVICES_VOID, "none"})


@dataclass(frozen=True, slots=True)
class Running:
    """A live container of the runtime, as the decision reads it, and its resolved assignment."""

    id: str
    request: ContainerRequest
    resolution: Resolution


def sandbox_states(pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container]) -> list[SandboxState]:
    """Each pod sandbox, ready while one of its containers is live: NRI's PodSandbox carries no state."""
    live = {c.pod_sandbox_id for c in containers if c.state in LIVE}
    return [SandboxState(pod.id, pod.uid, pod.id in live) for pod in pods]


def live_containers(
    pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container]
) -> list[tuple[nri_pb2.PodSandbox, nri_pb2.Container]]:
    """The live containers, each with its pod (one whose pod the runtime didn't list is left out)."""
    by_id = {pod.id: pod for pod in pods}
    return [(by_id[c.pod_sandbox_id], c) for c in containers if c.state in LIVE and c.pod_sandbox_id in by_id]


def ended_pods(pods: Sequence[nri_pb2.PodSandbox], states: Sequence[SandboxState]) -> list[nri_pb2.PodSandbox]:
    """The sandboxes whose limits go: not ready, of a pod with no ready sandbox (the rule of
    :func:`gpushare.enforcement.limits.runs_elsewhere`)."""
    ready = {s.id for s in states if s.ready}
    running = {s.pod_uid for s in states if s.ready}
    return [pod for pod in pods if pod.id not in ready and pod.uid not in running]


def misplaced(request: ContainerRequest, resolution: Resolution, block_unrequested_gpu: bool) -> str | None:
    """Why a live container sees what it must not, naming pod, container and cards; None when it sees
    what it should or its assignment can't be read (``resolution.refusal``). What it sees is its env: the
    container's annotations are those the device plugin gave, whatever the plugin's adjustment set."""
    if resolution.refusal is not None:
        return None
    target = resolution.target
    visible = request.env_values(ENV_VISIBLE_DEVICES)
    seen = f"{ENV_VISIBLE_DEVICES}={' | '.join(visible) or '(unset)'}"
    if resolution.dra_env is not None:
        wrong = sorted(key for key, value in resolution.dra_env.items() if request.env_values(key) != [value])
        if not wrong:
            return None
        return f"{target} sees {seen}; its ResourceClaims give it {resolution.dra_env.get(ENV_VISIBLE_DEVICES, '')}"
    if resolution.wants_gpu:
        wanted = ",".join(s.uuid for s in resolution.slices)
        if visible == [wanted]:
            return None
        return f"{target} sees {seen}; the scheduler assigned {describe(resolution.slices)}"
    if not block_unrequested_gpu or all(v in NO_CARD for v in visible):
        return None
    return f"{target} requests no GPU but sees {seen}"


def evictions(
    running: Sequence[Running], unlimited: Mapping[str, str], block_unrequested_gpu: bool
) -> list[nri_pb2.ContainerEviction]:
    """The live containers to evict: those :func:`misplaced` names, and the GPU containers of the pods in
    ``unlimited`` (pod UID -> why its limits couldn't be set)."""
    found = []
    for container in running:
        resolution = container.resolution
        why = misplaced(container.request, resolution, block_unrequested_gpu)
        uid = resolution.target.uid
        if why is None and resolution.wants_gpu and resolution.refusal is None and uid in unlimited:
            why = f"{resolution.target} runs without its memory limits: {unlimited[uid]}"
        if why is not None:
            found.append(nri_pb2.ContainerEviction(container_id=container.id, reason=why))
    return found
