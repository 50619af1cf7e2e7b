"""Which pending container an Allocate call is for.

Allocate carries only a device count, no pod. Like the original gpushare plugin we take the pending
pod on this node with the earliest assume time, but we match per container (init containers first)
and per resource, and break ties by creation time and then UID so that the answer never depends on
the order the API or a dict happens to list things in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.aliyun import parse_assume_time, parse_bool
from gpushare.contract.allocation import parse_assigned_containers
from gpushare.contract.errors import AnnotationError, ContractError
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_ASSIGNED_CONTAINERS,
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_IDX,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.request import ContainerRequest, PodRequest, annotations_of, parse_pod_request, pod_key

#: annotations that show a gpushare scheduler (ours or the original) has placed the pod
SCHEDULED_MARKERS = (ANN_ALLOCATION, ANN_MEM_IDX, ANN_MEM_ASSUME_TIME)


@dataclass(frozen=True, slots=True)
class Skipped:
    """A pending pod that was passed over because its request or annotations can't be read."""

    pod: Mapping[str, Any]
    reason: str


@dataclass(frozen=True, slots=True)
class Match:
    pod: Mapping[str, Any]
    request: PodRequest
    container: ContainerRequest
    served: dict[str, frozenset[str]]
    #: unreadable pods passed over on the way (each should hear about it; the match is unaffected)
    skipped: tuple[Skipped, ...] = ()


def container_units(container: ContainerRequest, resource: str) -> int:
    return container.mem if resource == RESOURCE_MEM else container.count


def _awaiting_allocation(pod: Mapping[str, Any], node: str) -> bool:
    meta = pod.get("metadata") or {}
    ann = annotations_of(pod)
    return (
        (pod.get("spec") or {}).get("nodeName") == node
        and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
        and not meta.get("deletionTimestamp")
        and any(k in ann for k in SCHEDULED_MARKERS)
        and not parse_bool(ann.get(ANN_MEM_ASSIGNED))
    )


def _order(pod: Mapping[str, Any]) -> tuple[int, str, str, str]:
    meta = pod.get("metadata") or {}
    assume = annotations_of(pod).get(ANN_MEM_ASSUME_TIME)
    # A pod without an assume time was placed by something else; serve it after the ones that have one.
    assume_ns = parse_assume_time(assume, pod_key(pod)) if assume is not None else 2**63
    return assume_ns, meta.get("creationTimestamp") or "", meta.get("uid") or "", pod_key(pod)


def match_container(pods: Iterable[Mapping[str, Any]], node: str, resource: str, units: int) -> Match | None:
    """The first unserved container asking for exactly ``units`` of ``resource``, or None.

    A pending pod whose limits, assume time or served-containers record can't be read is skipped:
    one bad pod must not block every Allocate of its size on the node. The skipped pods ride along on
    the match; when nothing else matches, a ContractError names them.
    """
    candidates = []
    skipped: list[Skipped] = []
    annotation_errors = False
    for pod in pods:
        if not _awaiting_allocation(pod, node):
            continue
        try:
            request = parse_pod_request(pod)
            if not any(container_units(c, resource) == units for c in request.gpu_containers):
                continue
            order = _order(pod)
            served = parse_assigned_containers(annotations_of(pod).get(ANN_ASSIGNED_CONTAINERS), request.key)
        except ContractError as exc:
            skipped.append(Skipped(pod, str(exc)))
            annotation_errors = annotation_errors or isinstance(exc, AnnotationError)
            continue
        candidates.append((order, pod, request, served))
    for _, pod, request, served in sorted(candidates, key=lambda item: item[0]):
        for container in request.gpu_containers:
            if container_units(container, resource) == units and resource not in served.get(container.name, ()):
                return Match(pod, request, container, served, tuple(skipped))
    if skipped:
        reasons = "; ".join(sorted(s.reason for s in skipped))
        error = AnnotationError if annotation_errors else ContractError
        raise error(f"no readable pending pod asks for {units} {resource}; unreadable: {reasons}")
    return None


def requested_resources(container: ContainerRequest) -> frozenset[str]:
    return frozenset(r for r in (RESOURCE_MEM, RESOURCE_COUNT) if container_units(container, r))


def fully_served(request: PodRequest, served: Mapping[str, frozenset[str]]) -> bool:
    """Every GPU container has had an Allocate for every gpushare resource it requests."""
    return all(requested_resources(c) <= served.get(c.name, frozenset()) for c in request.gpu_containers)
