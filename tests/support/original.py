"""Helpers that stand for the original gpushare components in tests of moving from them."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client

from gpushare.contract.names import (
    ANN_FRAMEWORK_ALLOCATION,
    ANN_MEM_IDX,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.request import parse_pod_request


def original_node(core: client.CoreV1Api, name: str, mem: int, count: int, ip: str = "10.0.0.7") -> None:
    """A node that runs the original device plugin: no inventory annotation, only its status."""
    core.create_node({"metadata": {"name": name}})
    amounts = {RESOURCE_MEM: str(mem), RESOURCE_COUNT: str(count)}
    core.patch_node_status(
        name,
        {"status": {"capacity": amounts, "allocatable": amounts, "addresses": [{"type": "InternalIP", "address": ip}]}},
    )


def original_inspect_usage(pod: dict[str, Any]) -> dict[int, int]:
    """What the original kubectl-inspect-gpushare counts for a pod: the framework annotation summed
    per card when it is there, else the pod's app-container gpu-mem on its IDX card."""
    ann = pod["metadata"].get("annotations") or {}
    if ANN_FRAMEWORK_ALLOCATION in ann:
        per_card: dict[int, int] = {}
        for cards in json.loads(ann[ANN_FRAMEWORK_ALLOCATION]).values():
            for number, units in cards.items():
                per_card[int(number)] = per_card.get(int(number), 0) + units
        return per_card
    return {int(ann[ANN_MEM_IDX]): parse_pod_request(pod).app_mem}
