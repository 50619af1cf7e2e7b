"""The original gpushare's formats: its pod annotations, the newer extender's framework allocation, and
the fence ConfigMap that takes cards out of its extender's hands."""

from __future__ import annotations

import json
from collections.abc import Mapping

from gpushare.contract.errors import AnnotationError, quoted
from gpushare.contract.names import ANN_FRAMEWORK_ALLOCATION, ANN_MEM_ASSUME_TIME, ANN_MEM_IDX
from gpushare.contract.request import PodRequest
from gpushare.contract.units import CARDS_LIMIT, bounded


def parse_card_index(text: str, pod: str = "?") -> int:
    try:
        index = int(str(text).strip())
    except ValueError:
        raise AnnotationError(f"pod {pod} annotation {ANN_MEM_IDX}: {quoted(text)} is not an integer") from None
    if index < 0:
        raise AnnotationError(f"pod {pod} annotation {ANN_MEM_IDX}: {index} is negative")
    return bounded(index, CARDS_LIMIT, f"pod {pod} annotation {ANN_MEM_IDX}")


def parse_assume_time(text: str, pod: str = "?") -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise AnnotationError(
            f"pod {pod} annotation {ANN_MEM_ASSUME_TIME}: {quoted(text)} is not integer nanoseconds"
        ) from None
    if value < 0:
        raise AnnotationError(f"pod {pod} annotation {ANN_MEM_ASSUME_TIME}: {value} is negative")
    return value


def format_assume_time(ns: int) -> str:
    return str(int(ns))


def parse_bool(text: str | None) -> bool:
    return str(text).strip().lower() == "true"


def format_bool(value: bool) -> str:
    return "true" if value else "false"


def parse_fenced_cards(text: str | None) -> frozenset[int]:
    """The card numbers in a fence ConfigMap's ``gpus`` value (``"0,2"``). Entries that aren't numbers
    are skipped, as the original extender skips them."""
    fenced = set()
    for part in (text or "").split(","):
        part = part.strip()
        if part.isdigit():
            fenced.add(int(part))
    return frozenset(fenced)


def format_framework_allocation(amounts: Mapping[str, Mapping[int, int]], request: PodRequest) -> str:
    """``{"<app container position>": {"<card number>": units}}`` from container name -> card number ->
    units. The original components count containers in ``spec.containers`` only, so init containers
    can't be named, and number cards by their /dev/nvidia minor."""
    positions = {c.name: i for i, c in enumerate(c for c in request.containers if not c.init)}
    if unknown := sorted(set(amounts) - set(positions)):
        raise AnnotationError(
            f"pod {request.key}: {ANN_FRAMEWORK_ALLOCATION} can't name init or unknown containers {quoted(unknown)}"
        )
    return json.dumps(
        {
            str(positions[name]): {str(number): units for number, units in sorted(cards.items())}
            for name, cards in sorted(amounts.items(), key=lambda item: positions[item[0]])
        },
        separators=(",", ":"),
    )
