"""What both transports build their decision from: the node's pods (API lookups when allowed), the
driver's memory limits, and the Events recorded about pods."""

from __future__ import annotations

from typing import Any, TypeVar

from gpushare.enforcement.container import Target
from gpushare.enforcement.decide import Enforcer, EventSink
from gpushare.enforcement.resolve import CachedPods, Resolver
from gpushare.gpus.backend import GpuBackend
from gpushare.kube.events import EventSource
from gpushare.kube.nodeapi import NodeApi
from gpushare.kube.watch import WatchCache
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.settings import NodeSettings, ShimSettings

E = TypeVar("E", bound=Enforcer)


def pod_events(events: EventSource) -> EventSink:
    """The decision's Events, recorded about the pod its container is for."""

    def record(target: Target, reason: str, message: str, type_: str) -> None:
        pod = {"kind": "Pod", "metadata": {"name": target.pod, "namespace": target.namespace, "uid": target.uid}}
        events.record(pod, reason=reason, message=message, type_=type_)

    return record


def build_enforcer(
    kind: type[E],
    node: NodeSettings,
    settings: ShimSettings,
    backend: GpuBackend,
    api: Any | None,
    node_api: NodeApi | None,
    component: str,
) -> tuple[E, WatchCache | None]:
    """An :class:`Enforcer` (or the transport's subclass ``kind``) for ``backend``'s cards, and the pod
    cache its API lookups read (None without them: no ``node_api`` or ``settings.allow_api_fetch`` off).
    Its Events are recorded as ``component``."""
    cache = node_api.pods if node_api is not None and settings.allow_api_fetch else None
    resolver = Resolver(node.memory_unit, CachedPods(api, cache, node.node_name) if cache is not None else None)
    limiter = PodLimiter(backend.set_memory_limit, node.cgroup_layout(), node.memory_unit)
    events = pod_events(node_api.events.for_component(component)) if node_api is not None else None
    return kind(resolver, backend.cards, node.memory_unit, settings.options, events, limiter), cache
