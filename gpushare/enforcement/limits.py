"""A pod's GPU memory limits, set before its GPU container is created, and a GPU container's, set before
its process starts, whichever transport heard of the container; and the one rule for taking them off
when a sandbox of the pod ends."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpushare.assignment import Refusal
from gpushare.cards import Card
from gpushare.contract.names import ENV_VISIBLE_DEVICES
from gpushare.contract.resourceclaim import ClaimError
from gpushare.enforcement.container import Target
from gpushare.enforcement.resolve import Resolution, Resolver
from gpushare.memlimits.enforcer import PodLimiter

#: the refusal reason (and metric label) of a pod whose memory limit the driver did not set
MEMORY_LIMIT = "memory-limit"


def limit_pod(
    resolver: Resolver,
    limiter: PodLimiter | None,
    resolution: Resolution,
    sandbox_annotations: Mapping[str, str],
    cgroup_parent: str,
    cards: Sequence[Card],
) -> Refusal | None:
    """Hold the pod to its share of each card it shares (through the device plugin and its
    ResourceClaims), before its GPU container is created; the refusal when that can't be done. Nothing
    to do without a limiter, for a container with no GPU, or where no card enforces limits."""
    if limiter is None or not resolution.wants_gpu or not any(card.limits_enforced for card in cards):
        return None
    try:
        held = resolver.pod_held(resolution, sandbox_annotations, cards)
    except ClaimError as exc:
        return Refusal(MEMORY_LIMIT, f"{resolution.target}: its memory limits can't be set: {exc}")
    why = limiter.apply(str(resolution.target), cgroup_parent, held, cards)
    return None if why is None else Refusal(MEMORY_LIMIT, why)


def container_held(
    resolver: Resolver, resolution: Resolution, sandbox_annotations: Mapping[str, str], cards: Sequence[Card]
) -> dict[str, int]:
    """Units the container holds per card UUID: its slices; for a container given cards by ResourceClaims,
    what its pod's claims hold on the cards its claims' env names (claims don't say which of a pod's
    containers uses how much). Raises ClaimError as :meth:`Resolver.pod_held`."""
    if not resolution.dra_devices:
        held: dict[str, int] = {}
        for part in resolution.slices:
            held[part.uuid] = held.get(part.uuid, 0) + part.units
        return held
    seen = set((resolution.dra_env or {}).get(ENV_VISIBLE_DEVICES, "").split(","))
    pod = resolver.pod_held(resolution, sandbox_annotations, cards)
    return {uuid: units for uuid, units in pod.items() if uuid in seen}


def limit_container(
    resolver: Resolver,
    limiter: PodLimiter,
    resolution: Resolution,
    sandbox_annotations: Mapping[str, str],
    cgroups_path: str,
    cards: Sequence[Card],
    make: bool,
) -> Refusal | None:
    """Hold the GPU container to its share of each card it shares, on its own cgroup (``cgroups_path``,
    from its runtime spec), before its process starts; the refusal when that can't be done. ``make``:
    create the cgroup first (see :meth:`PodLimiter.apply_container`)."""
    if not resolution.wants_gpu:
        return None
    try:
        held = container_held(resolver, resolution, sandbox_annotations, cards)
    except ClaimError as exc:
        return Refusal(MEMORY_LIMIT, f"{resolution.target}: its memory limits can't be set: {exc}")
    why = limiter.apply_container(str(resolution.target), cgroups_path, held, cards, make)
    return None if why is None else Refusal(MEMORY_LIMIT, why)


def limit_running_pod(
    resolver: Resolver,
    limiter: PodLimiter,
    target: Target,
    sandbox_annotations: Mapping[str, str],
    cgroup_parent: Callable[[], str],
    cards: Sequence[Card],
) -> tuple[bool, str | None]:
    """Set again the limits of a pod already running (after a start of the agent, or of its NRI
    session), as if its containers were being created now: (whether it holds anything to limit, why
    that failed, naming the pod; None when it didn't). A running pod can't be refused, so the caller
    says what happens then. ``cgroup_parent`` is asked only for a pod that holds something."""
    try:
        held = resolver.pod_held(Resolution(target, wants_gpu=True), sandbox_annotations, cards)
    except ClaimError as exc:
        return True, f"pod {target.pod_key}: {exc}"
    if not held:
        return False, None
    return True, limiter.apply(f"pod {target.pod_key}", cgroup_parent(), held, cards)


@dataclass(frozen=True, slots=True)
class SandboxState:
    """A pod sandbox as the runtime lists it."""

    id: str
    pod_uid: str
    ready: bool


def runs_elsewhere(sandboxes: Iterable[SandboxState], pod_uid: str, ending: str) -> bool:
    """Whether the pod ``pod_uid`` has a ready sandbox other than ``ending``: kubelet recreates a pod's
    sandbox when it dies, in the same pod cgroup, and stops or removes the old one later (garbage
    collection), while the new one's containers run under the limits, which must then stay."""
    return any(s.id != ending and s.pod_uid == pod_uid and s.ready for s in sandboxes)
