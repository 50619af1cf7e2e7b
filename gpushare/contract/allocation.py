"""Our pod annotations that record a decision: which cards each container holds
(``gpushare.io/allocation``) and which resources the device plugin has served it
(``gpushare.io/assigned-containers``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract import jsondepth
from gpushare.contract.errors import AnnotationError, json_object, quoted
from gpushare.contract.names import ANN_ALLOCATION, ANN_ASSIGNED_CONTAINERS, RESOURCES
from gpushare.contract.request import PodRequest
from gpushare.contract.units import CARDS_LIMIT, UNITS_LIMIT, bounded


@dataclass(frozen=True, slots=True, order=True)
class CardSlice:
    """``units`` of one card given to one container."""

    index: int
    uuid: str
    units: int


Allocation = dict[str, tuple[CardSlice, ...]]


def _parse_slice(pod: str, container: str, raw: Any) -> CardSlice:
    where = f"pod {pod} annotation {ANN_ALLOCATION} container {quoted(container)}"
    if not isinstance(raw, dict):
        raise AnnotationError(f"{where}: entry {quoted(raw)} is not an object")
    index, uuid, units = raw.get("index"), raw.get("uuid"), raw.get("units")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise AnnotationError(f"{where}: card index {quoted(index)} is not a non-negative integer")
    if not isinstance(uuid, str) or not uuid.startswith("GPU-"):
        raise AnnotationError(f"{where}: card uuid {quoted(uuid)} is not a GPU UUID")
    if not isinstance(units, int) or isinstance(units, bool) or units <= 0:
        raise AnnotationError(f"{where}: units {quoted(units)} on card {index} is not a positive integer")
    bounded(index, CARDS_LIMIT, f"{where}: card index")
    bounded(units, UNITS_LIMIT, f"{where}: units on card {index}")
    return CardSlice(index=index, uuid=uuid, units=units)


def parse_allocation(text: str, pod: str = "?") -> Allocation:
    where = f"pod {pod} annotation {ANN_ALLOCATION}"
    raw = json_object(text, where, "an object of container name -> cards")
    result: Allocation = {}
    for container, slices in raw.items():
        if not isinstance(slices, list) or not slices:
            raise AnnotationError(f"{where}: container {quoted(container)} has no card list")
        parsed = tuple(_parse_slice(pod, container, s) for s in slices)
        if len({s.uuid for s in parsed}) != len(parsed):
            raise AnnotationError(f"{where}: container {quoted(container)} lists the same card twice")
        result[container] = parsed
    return result


def format_allocation(allocation: Mapping[str, tuple[CardSlice, ...]]) -> str:
    return json.dumps(
        {
            name: [{"index": s.index, "uuid": s.uuid, "units": s.units} for s in slices]
            for name, slices in sorted(allocation.items())
        },
        separators=(",", ":"),
    )


def validate_allocation(request: PodRequest, allocation: Allocation) -> None:
    """Check that an allocation is shaped like the request it claims to serve."""
    for c in request.gpu_containers:
        slices = allocation.get(c.name)
        where = f"pod {request.key} container {c.name}"
        if not slices:
            raise AnnotationError(f"{where}: requests a GPU but {ANN_ALLOCATION} assigns it no card")
        if len(slices) != c.cards:
            raise AnnotationError(f"{where}: requests {c.cards} card(s) but is assigned {len(slices)}")
        if not c.exclusive and any(s.units != c.units_per_card for s in slices):
            raise AnnotationError(
                f"{where}: requests {c.units_per_card} unit(s) per card but is assigned {[s.units for s in slices]}"
            )


def parse_assigned_containers(text: str | None, pod: str = "?") -> dict[str, frozenset[str]]:
    """Which resources the device plugin has served to each container (JSON name -> [resource])."""
    if not text:
        return {}
    where = f"pod {pod} annotation {ANN_ASSIGNED_CONTAINERS}"
    try:
        raw = jsondepth.loads(text)
    except ValueError:
        raise AnnotationError(f"{where}: not valid JSON") from None
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(r in RESOURCES for r in v) for v in raw.values()
    ):
        raise AnnotationError(f"{where}: expected an object of container name -> list of gpushare resources")
    return {name: frozenset(served) for name, served in raw.items()}


def format_assigned_containers(served: Mapping[str, frozenset[str]]) -> str:
    return json.dumps({name: sorted(res) for name, res in sorted(served.items())}, separators=(",", ":"))
