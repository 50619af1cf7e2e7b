"""What a pod asks for: its containers' ``aliyun.com/gpu-mem`` and ``aliyun.com/gpu-count``, read from
its spec by Kubernetes' rules."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.errors import RequestError, quoted
from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM, RESOURCES
from gpushare.contract.units import CARDS_LIMIT, UNITS_LIMIT, QuantityError, bounded


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """One container's GPU request, in the plugin's units.

    ``mem`` alone: ``mem`` units on one card. ``count`` alone: ``count`` whole cards, exclusively.
    Both: ``count`` distinct cards with ``mem // count`` units each.
    """

    name: str
    init: bool
    mem: int = 0
    count: int = 0

    @property
    def wants_gpu(self) -> bool:
        return self.mem > 0 or self.count > 0

    @property
    def exclusive(self) -> bool:
        return self.count > 0 and self.mem == 0

    @property
    def cards(self) -> int:
        return self.count if self.count else 1

    @property
    def units_per_card(self) -> int:
        """Units taken on each card; 0 for exclusive requests (the whole card)."""
        return self.mem // self.cards


@dataclass(frozen=True, slots=True)
class PodRequest:
    """Every container's GPU request, init containers first, as :func:`parse_pod_request` read them."""

    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerRequest, ...]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def gpu_containers(self) -> tuple[ContainerRequest, ...]:
        return tuple(c for c in self.containers if c.wants_gpu)

    @property
    def app_mem(self) -> int:
        """gpu-mem over the app containers; what the original components count for a pod."""
        return sum(c.mem for c in self.containers if not c.init)

    @property
    def effective_mem(self) -> int:
        """The pod's gpu-mem request by Kubernetes' rule (:func:`effective_request`)."""
        return effective_request(
            (c.mem for c in self.containers if not c.init), (c.mem for c in self.containers if c.init)
        )

    def container(self, name: str) -> ContainerRequest | None:
        return next((c for c in self.containers if c.name == name), None)


def effective_request(apps: Iterable[int], inits: Iterable[int]) -> int:
    """Kubernetes' rule for how much of one resource a pod needs: init containers run one at a time
    before the app containers, so the larger of the app containers' sum and its largest init container."""
    return max(sum(apps), max(inits, default=0))


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '?')}"


def annotations_of(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def _parse_quantity(value: Any, where: str, limit: int) -> int:
    """Extended resources are whole numbers; accept ints and integral strings only, up to ``limit``."""
    if isinstance(value, bool):
        raise RequestError(f"{where}: {quoted(value)} is not a whole number")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        if not re.fullmatch(r"[0-9]+", text):
            raise RequestError(f"{where}: {quoted(value)} is not a whole number")
        if len(text.lstrip("0")) > len(str(limit)):  # too long to be within it: not made into a number
            raise QuantityError(f"{where}: {quoted(value)} is more than the {limit} allowed")
        number = int(text)
    if number < 0:
        raise RequestError(f"{where}: {number} is negative")
    return bounded(number, limit, where)


def _container_request(pod: str, spec: Mapping[str, Any], init: bool) -> ContainerRequest:
    name = spec.get("name") or "?"
    resources = spec.get("resources") or {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    # Kubernetes defaults requests to limits for extended resources and forbids them differing.
    values = {r: limits.get(r, requests.get(r)) for r in RESOURCES}
    mem = (
        _parse_quantity(values[RESOURCE_MEM], f"pod {pod} container {name} {RESOURCE_MEM}", UNITS_LIMIT)
        if values[RESOURCE_MEM] is not None
        else 0
    )
    count = (
        _parse_quantity(values[RESOURCE_COUNT], f"pod {pod} container {name} {RESOURCE_COUNT}", CARDS_LIMIT)
        if values[RESOURCE_COUNT] is not None
        else 0
    )
    if mem and count and mem % count:
        raise RequestError(
            f"pod {pod} container {name}: {RESOURCE_MEM}={mem} is not divisible by {RESOURCE_COUNT}={count}"
        )
    return ContainerRequest(name=name, init=init, mem=mem, count=count)


def parse_pod_request(pod: Mapping[str, Any]) -> PodRequest:
    """The GPU request of every container (init containers first, in spec order)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    key = pod_key(pod)
    containers = tuple(_container_request(key, c, True) for c in spec.get("initContainers") or []) + tuple(
        _container_request(key, c, False) for c in spec.get("containers") or []
    )
    return PodRequest(
        namespace=meta.get("namespace", "default"),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        containers=containers,
    )


def requests_gpu(pod: Mapping[str, Any]) -> bool:
    """True when any container names a gpushare resource (even with a malformed value)."""
    spec = pod.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        res = c.get("resources") or {}
        if any(r in (res.get("limits") or {}) or r in (res.get("requests") or {}) for r in RESOURCES):
            return True
    return False
