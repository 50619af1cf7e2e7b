"""Build pods the way the gpushare extender leaves them, for tests."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from gpushare.cards import Card
from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_IDX,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)

_assume = itertools.count(1_700_000_000_000_000_000, 1_000)


def container(
    name: str, mem: int = 0, count: int = 0, env: dict[str, str] | None = None, image: str = "busybox"
) -> dict[str, Any]:
    limits = {}
    if mem:
        limits[RESOURCE_MEM] = str(mem)
    if count:
        limits[RESOURCE_COUNT] = str(count)
    spec: dict[str, Any] = {"name": name, "image": image, "resources": {"limits": limits}}
    if env:
        spec["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return spec


def slices(cards: Sequence[Card], units: int) -> tuple[CardSlice, ...]:
    return tuple(CardSlice(card.index, card.uuid, units) for card in cards)


def gpu_pod(
    name: str,
    containers: Sequence[dict[str, Any]],
    *,
    node: str | None = "n1",
    allocation: dict[str, tuple[CardSlice, ...]] | None = None,
    original_index: int | None = None,
    assume_ns: int | None = None,
    init: Sequence[dict[str, Any]] = (),
    extra_annotations: dict[str, str] | None = None,
    uid: str | None = None,
    created: str | None = None,
    phase: str | None = None,
    namespace: str | None = "default",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the extender binds it: our allocation and/or the original keys, ASSIGNED=false.

    ``uid``, ``created`` and ``phase`` stand in for what the API server fills in, for pure tests;
    ``namespace=None`` leaves the namespace to the request that creates the pod.
    """
    annotations: dict[str, str] = {}
    if allocation is not None or original_index is not None:
        annotations[ANN_MEM_ASSIGNED] = "false"
        annotations[ANN_MEM_ASSUME_TIME] = str(assume_ns if assume_ns is not None else next(_assume))
    if allocation is not None:
        annotations[ANN_ALLOCATION] = format_allocation(allocation)
        first = next(iter(allocation.values()))[0]
        annotations[ANN_MEM_IDX] = str(first.index)
    if original_index is not None:
        annotations[ANN_MEM_IDX] = str(original_index)
    annotations.update(extra_annotations or {})
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    if node:
        spec["nodeName"] = node
    meta: dict[str, Any] = {"name": name, "annotations": annotations}
    if namespace is not None:
        meta["namespace"] = namespace
    if labels is not None:
        meta["labels"] = labels
    if uid is not None:
        meta["uid"] = uid
    if created is not None:
        meta["creationTimestamp"] = created
    pod: dict[str, Any] = {"metadata": meta, "spec": spec}
    if phase is not None:
        pod["status"] = {"phase": phase}
    return pod
