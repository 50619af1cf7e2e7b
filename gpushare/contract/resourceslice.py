"""A live ResourceSlice of the DRA driver ``gpu.gpushare.io`` read back: its pool, its generation and
the cards it offers.

The advertiser writes the slice (:mod:`gpushare.advertiser.resourceslice`) and reads its generation
back when it starts; the extender and ``inspect`` read every node's slices to see the cards DRA
offers there. The slice's layout is :mod:`gpushare.contract.dra`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.dra import parse_device_name, parse_memory_bytes
from gpushare.contract.errors import ContractError
from gpushare.contract.names import DRA_ATTR_MODEL, DRA_ATTR_UUID, DRA_CAPACITY_MEMORY


class ResourceSliceError(ContractError):
    """Cards, a node name or a generation that can't make a valid ResourceSlice, or a live slice whose
    devices can't be read back."""


@dataclass(frozen=True, slots=True)
class OfferedCard:
    """A card as a ResourceSlice of the driver offers it, read back (:func:`offered_cards`)."""

    device: str
    index: int
    uuid: str
    model: str
    memory_bytes: int
    #: ``requestPolicy.default`` of its memory: one of the node's memory units, in bytes (None when unset)
    unit_bytes: int | None


def live_pool(live: Mapping[str, Any]) -> str:
    """The pool (the node) a live slice belongs to ("" when it names none)."""
    pool = ((live.get("spec") or {}).get("pool") or {}).get("name")
    return pool if isinstance(pool, str) else ""


def live_generation(live: Mapping[str, Any]) -> int:
    """The pool generation of a live slice (0 when it has none)."""
    generation = ((live.get("spec") or {}).get("pool") or {}).get("generation")
    return generation if isinstance(generation, int) else 0


def _string_attribute(device: Mapping[str, Any], name: str) -> str:
    value = ((device.get("attributes") or {}).get(name) or {}).get("string")
    return value if isinstance(value, str) else ""


def _read(where: str, parse: Callable[[Any], int], raw: Any) -> int:
    try:
        return parse(raw)
    except ContractError as exc:
        raise ResourceSliceError(f"{where}: {exc}") from None


def _offered_card(device: Any, where: str) -> OfferedCard:
    if not isinstance(device, Mapping):
        raise ResourceSliceError(f"{where}: {device!r} is not an object")
    memory = (device.get("capacity") or {}).get(DRA_CAPACITY_MEMORY) or {}
    default = (memory.get("requestPolicy") or {}).get("default")
    at = f"{where}.capacity.{DRA_CAPACITY_MEMORY}"
    return OfferedCard(
        device=device.get("name"),
        index=_read(f"{where}.name", parse_device_name, device.get("name")),
        uuid=_string_attribute(device, DRA_ATTR_UUID),
        model=_string_attribute(device, DRA_ATTR_MODEL),
        memory_bytes=_read(f"{at}.value", parse_memory_bytes, memory.get("value")),
        unit_bytes=None if default is None else _read(f"{at}.requestPolicy.default", parse_memory_bytes, default),
    )


def offered_cards(live: Mapping[str, Any]) -> tuple[OfferedCard, ...]:
    """The cards a live slice of the driver offers (the inverse of
    :func:`gpushare.advertiser.resourceslice.resource_slice`), or a :class:`ResourceSliceError` naming the
    slice, the device and the field that can't be read."""
    name = (live.get("metadata") or {}).get("name", "?")
    devices = (live.get("spec") or {}).get("devices") or []
    return tuple(_offered_card(d, f"ResourceSlice {name}: spec.devices[{i}]") for i, d in enumerate(devices))


def offered_by_pool(slices: Iterable[Mapping[str, Any]]) -> tuple[dict[str, tuple[OfferedCard, ...]], list[str]]:
    """Each pool's cards, from its slices of the newest generation (the scheduler ignores older ones)."""
    by_pool: dict[str, list[Mapping[str, Any]]] = {}
    for live in slices:
        by_pool.setdefault(live_pool(live), []).append(live)
    offered: dict[str, tuple[OfferedCard, ...]] = {}
    problems = []
    for pool, lives in by_pool.items():
        newest = max(live_generation(live) for live in lives)
        cards: list[OfferedCard] = []
        for live in (live for live in lives if live_generation(live) == newest):
            try:
                cards.extend(offered_cards(live))
            except ResourceSliceError as exc:
                problems.append(f"{exc}; its cards are not shown")
        offered[pool] = tuple(sorted(cards, key=lambda c: c.index))
    return offered, problems
