"""The whole decision about a container being created, as both transports take it: resolve its cards,
rewrite what it was given, set its pod's memory limits, and say so (one log line naming pod, container
and card, and a Kubernetes Event for a correction or a refusal); and, as it starts, its own limits."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpushare.assignment import Refusal, describe
from gpushare.cards import Card
from gpushare.contract.names import ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID
from gpushare.contract.units import MemoryUnit
from gpushare.enforcement.container import ContainerRequest, Decision, Target
from gpushare.enforcement.limits import limit_container, limit_pod
from gpushare.enforcement.resolve import Resolution, Resolver
from gpushare.enforcement.rewrite import rewrite
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.settings import RewriteOptions

log = logging.getLogger(__name__)

EVENT_CORRECTED = "GPUAssignmentCorrected"
EVENT_REFUSED = "GPUAssignmentRefused"

#: (pod, reason, message, type) -> records a Kubernetes Event; must not block
EventSink = Callable[[Target, str, str, str], None]


@dataclass(frozen=True, slots=True)
class Enforcer:
    """Decides about each container being created (:meth:`decide`)."""

    resolver: Resolver
    cards: Callable[[], Sequence[Card]]
    unit: MemoryUnit
    options: RewriteOptions
    events: EventSink | None = None
    #: sets the pod's GPU memory limits before its GPU containers are created (None: limits are off)
    limiter: PodLimiter | None = None

    def decide(self, request: ContainerRequest) -> tuple[Resolution, Decision]:
        """The container's resolution and the decision; a decision to let it through has set its pod's
        memory limits, and one that can't is a refusal."""
        cards = list(self.cards())
        resolution = self.resolver.resolve(request, cards)
        decision = rewrite(request, resolution, cards, self.unit, self.options)
        refusal = decision.refusal or limit_pod(
            self.resolver, self.limiter, resolution, request.sandbox_annotations, request.cgroup_parent, cards
        )
        if refusal is not None:
            log.warning("refused CreateContainer (%s): %s", refusal.reason, refusal.message)
            self._event(resolution.target, EVENT_REFUSED, refusal.message, "Warning")
            return resolution, Decision(refusal=refusal)
        if decision.edits is None:
            if resolution.wants_gpu:
                log.info("%s: %s as assigned (%s)", resolution.target, describe(resolution.slices), resolution.source)
        elif decision.reason:
            log.warning("corrected CreateContainer (%s): %s", decision.reason, decision.message)
            self._event(resolution.target, EVENT_CORRECTED, decision.message, "Warning")
        elif resolution.dra_env is not None:
            log.info(
                "%s: GPU from its ResourceClaims (CDI device(s) %s): %s",
                resolution.target,
                ", ".join(resolution.dra_devices),
                " ".join(f"{k}={v}" for k, v in resolution.dra_env.items()),
            )
        else:
            log.debug("%s requests no GPU: %s=%s", resolution.target, ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID)
        return resolution, decision

    def start(self, request: ContainerRequest, cgroups_path: str, make: bool = False) -> Refusal | None:
        """Set the limits of a container about to start on its own cgroup (``cgroups_path``, as its runtime
        spec names it); the refusal when they can't be, its start must then fail. Nothing to do for a
        container with no GPU, or where no card enforces limits."""
        if self.limiter is None:
            return None
        cards = list(self.cards())
        if not any(card.limits_enforced for card in cards):
            return None
        resolution = self.resolver.resolve(request, cards)
        refusal = resolution.refusal or limit_container(
            self.resolver, self.limiter, resolution, request.sandbox_annotations, cgroups_path, cards, make
        )
        if refusal is not None:
            log.warning("refused StartContainer (%s): %s", refusal.reason, refusal.message)
            self._event(resolution.target, EVENT_REFUSED, refusal.message, "Warning")
        return refusal

    def _event(self, target: Target, reason: str, message: str, type_: str) -> None:
        if self.events is not None:
            self.events(target, reason, message, type_)
