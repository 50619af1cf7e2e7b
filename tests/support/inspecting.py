"""Nodes, pods, ResourceSlices and ResourceClaims as the API server lists them, and the tables
``gpushare inspect`` prints split into cells, for the inspect tests."""

from __future__ import annotations

import uuid
from typing import Any

from podfactory import gpu_pod

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.dra import format_device_name
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import (
    ANN_ALLOCATION,
    DRA_API_VERSION,
    DRA_DRIVER,
    NODE_ANN_INVENTORY,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.units import GIB, MemoryUnit
from support.draclaims import result


def node(name: str, ip: str, cards: Any = None, unit: MemoryUnit = GIB, capacity: dict | None = None) -> dict:
    annotations = {NODE_ANN_INVENTORY: format_inventory(cards, unit)} if cards is not None else {}
    return {
        "metadata": {"name": name, "annotations": annotations},
        "status": {
            "addresses": [{"type": "Hostname", "address": name}, {"type": "InternalIP", "address": ip}],
            "capacity": capacity or {},
        },
    }


def pod(
    name: str,
    node_name: str | None,
    containers: dict[str, dict[str, str]],
    annotations: dict | None = None,
    phase: str = "Pending",
) -> dict:
    specs = [{"name": n, "resources": {"limits": limits}} for n, limits in containers.items()]
    return gpu_pod(
        name, specs, node=node_name, namespace="team", uid=f"uid-{name}", phase=phase, extra_annotations=annotations
    )


def mem(units: int, count: int | None = None) -> dict[str, str]:
    return {RESOURCE_MEM: str(units), **({RESOURCE_COUNT: str(count)} if count else {})}


def placed(**containers: list[tuple[Any, int]]) -> dict[str, str]:
    allocation = {
        name: tuple(CardSlice(card.index, card.uuid, units) for card, units in slices)
        for name, slices in containers.items()
    }
    return {ANN_ALLOCATION: format_allocation(allocation)}


def rows(text: str) -> dict[str, list[str]]:
    """Table rows keyed by their first cell, split on the two-space column gap."""
    return {
        line.split()[0]: [cell.strip() for cell in line.split("  ") if cell.strip()]
        for line in text.splitlines()
        if line.strip()
    }


def dra_claim(name: str, node_name: str, *held: tuple[int, str], users: tuple[str, ...] = ()) -> dict[str, Any]:
    """ResourceClaim ``team/<name>`` as the scheduler leaves it: one request per entry of ``held``
    (card index, memory), allocated on that card of ``node_name``, reserved for the pods ``users``."""
    asked, results = [], []
    for i, (index, memory) in enumerate(held):
        request = f"gpu{i}"
        capacity = {"requests": {"memory": memory}}
        asked.append({"name": request, "exactly": {"deviceClassName": DRA_DRIVER, "capacity": capacity}})
        share_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{name}/{request}"))
        device = format_device_name(index)
        results.append(result(device=device, memory=memory, request=request, pool=node_name, shareID=share_id))
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"namespace": "team", "name": name, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": asked}},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": user, "uid": f"uid-{user}"} for user in users],
        },
    }
