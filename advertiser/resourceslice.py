"""The node's ResourceSlice of the DRA driver ``gpu.gpushare.io``, and whether the live one needs rewriting. Pure.

One slice per node, one pool named after the node, one device per healthy card:

- ``card-<NVML index>``, ``allowMultipleAllocations: true``, so several claims share one card;
- attributes ``uuid``, ``index``, ``minor``, ``model``, ``numa`` (when known) and ``nvlinkClique``;
- capacity ``memory``: the card's whole units in bytes, handed out in whole units (default one unit,
  requests rounded up to the next unit, at most the whole card).

**Unhealthy cards leave the slice.** Device taints (``DRADeviceTaints``, GA in 1.37) could mark them
instead, but a claim that tolerates the taint would still be given the card, while a device that isn't
published can't be allocated at all; the claims already allocated on it keep it (the scheduler counts
allocations by device name, so the card's capacity is still counted when it returns), and a slice with
taints is limited to 64 devices instead of 128.

**NVLink** is the ``nvlinkClique`` attribute: the lowest NVML index of the card's clique, set when the
card and its peers are all peers of each other (NVSwitch machines, NVLink-bridged pairs). A claim whose
cards must be NVLink peers asks for ``matchAttribute: gpu.gpushare.io/nvlinkClique``; a card without
peers, or in a topology that is no clique (a hybrid cube mesh), has no such attribute and can't be
matched. Lists of peers would need list-typed attributes, alpha (``DRAListTypeAttributes``) in 1.37.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpushare.advertiser.deviceorder import CardRoom
from kubernetes.utils.quantity import parse_quantity

from gpushare.cards import Card
from gpushare.contract.dra import format_device_name
from gpushare.contract.names import (
    DRA_API_VERSION,
    DRA_ATTR_INDEX,
    DRA_ATTR_MINOR,
    DRA_ATTR_MODEL,
    DRA_ATTR_NUMA,
    DRA_ATTR_NVLINK_CLIQUE,
    DRA_ATTR_UUID,
    DRA_CAPACITY_MEMORY,
    DRA_DRIVER,
    dra_slice_name,
)
from gpushare.contract.resourceslice import ResourceSliceError
from gpushare.contract.units import MemoryUnit

#: the API server's limits on one slice and one string attribute
MAX_DEVICES = 128
MAX_STRING_ATTRIBUTE = 64
#: a DNS subdomain, which the slice's name must be
MAX_NAME = 253


def _mib(mib: int) -> str:
    return f"{mib}Mi"


def _cliques(cards: Sequence[Card]) -> dict[str, int]:
    """Card UUID -> lowest NVML index of its NVLink clique, for cards whose peers are all peers of each other."""
    index = {card.uuid: card.index for card in cards}
    group = {card.uuid: frozenset({card.uuid, *card.nvlink_peers}) & index.keys() for card in cards}
    return {
        uuid: min(index[member] for member in members)
        for uuid, members in group.items()
        if len(members) > 1 and all(group[member] == members for member in members)
    }


def _device(card: Card, unit: MemoryUnit, clique: int | None) -> dict[str, Any]:
    units = unit.units_of(card.memory_mib)
    attributes: dict[str, dict[str, Any]] = {
        DRA_ATTR_UUID: {"string": card.uuid},
        DRA_ATTR_INDEX: {"int": card.index},
        DRA_ATTR_MINOR: {"int": card.minor},
        DRA_ATTR_MODEL: {"string": card.model},
    }
    if card.numa_node is not None:
        attributes[DRA_ATTR_NUMA] = {"int": card.numa_node}
    if clique is not None:
        attributes[DRA_ATTR_NVLINK_CLIQUE] = {"int": clique}
    one = _mib(unit.mib)
    valid_range = {"min": one, "max": _mib(units * unit.mib)}
    if units > 1:  # the API server wants min + step within the value
        valid_range["step"] = one
    return {
        "name": format_device_name(card.index),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            DRA_CAPACITY_MEMORY: {
                "value": _mib(units * unit.mib),
                "requestPolicy": {"default": one, "validRange": valid_range},
            }
        },
    }


def _check(node_name: str, cards: Sequence[Card], unit: MemoryUnit, generation: int) -> None:
    if not node_name:
        raise ResourceSliceError("ResourceSlice: the node name is empty")
    if len(dra_slice_name(node_name)) > MAX_NAME:
        raise ResourceSliceError(f"node {node_name}: name too long for a ResourceSlice name (at most {MAX_NAME})")
    if generation < 0:
        raise ResourceSliceError(f"node {node_name}: ResourceSlice generation {generation} is negative")
    if unit.mib <= 0:
        raise ResourceSliceError(f"node {node_name}: memory unit of {unit.mib} MiB is not positive")
    seen: dict[int, str] = {}
    for card in cards:
        if card.index in seen:
            raise ResourceSliceError(
                f"node {node_name}: cards {seen[card.index]} and {card.uuid} share NVML index {card.index}"
            )
        seen[card.index] = card.uuid
        for field, text in ((DRA_ATTR_UUID, card.uuid), (DRA_ATTR_MODEL, card.model)):
            if not text or len(text) > MAX_STRING_ATTRIBUTE:
                raise ResourceSliceError(
                    f"node {node_name} card {card.index}: {field} {text!r} must hold 1 to "
                    f"{MAX_STRING_ATTRIBUTE} characters"
                )
    if len(cards) > MAX_DEVICES:
        raise ResourceSliceError(f"node {node_name}: {len(cards)} cards; a ResourceSlice holds {MAX_DEVICES}")


def published_cards(cards: Sequence[Card], unit: MemoryUnit) -> list[Card]:
    """The cards the slice offers: healthy ones with at least one whole unit, in NVML index order."""
    return sorted((c for c in cards if c.healthy and unit.units_of(c.memory_mib) > 0), key=lambda c: c.index)


def card_rooms(cards: Sequence[Card], unit: MemoryUnit, used: Mapping[int, int]) -> list[CardRoom]:
    """The cards the slice offers as :func:`~gpushare.advertiser.deviceorder.best_fit_order` weighs them:
    the memory the slice offers of each and ``used`` (NVML index -> bytes allocated claims consume), in
    bytes, with its NUMA node and NVLink clique."""
    cliques = _cliques([c for c in cards if c.healthy])
    return [
        CardRoom(
            c.index, unit.units_of(c.memory_mib) * unit.bytes, used.get(c.index, 0), c.numa_node, cliques.get(c.uuid)
        )
        for c in published_cards(cards, unit)
    ]


def resource_slice(
    node_name: str, cards: Sequence[Card], unit: MemoryUnit, generation: int, order: Sequence[int] = ()
) -> dict[str, Any]:
    """The ResourceSlice offering ``node_name``'s healthy ``cards`` in whole ``unit``\\ s, as pool
    generation ``generation``; the devices of the NVML indexes ``order`` names first, in that order (the
    order kube-scheduler's first fit meets them), the others after them in index order. Raises
    :class:`ResourceSliceError` for input the API server would refuse."""
    _check(node_name, cards, unit, generation)
    cliques = _cliques([c for c in cards if c.healthy])
    rank = {index: i for i, index in enumerate(order)}
    offered = sorted(published_cards(cards, unit), key=lambda c: rank.get(c.index, len(rank)))
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": dra_slice_name(node_name)},
        "spec": {
            "driver": DRA_DRIVER,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": [_device(c, unit, cliques.get(c.uuid)) for c in offered],
        },
    }


#: the keys whose values are quantities in a slice's capacity
_QUANTITY_KEYS = frozenset({"value", "default", "min", "max", "step"})


def _comparable(spec: Mapping[str, Any]) -> Any:
    """``spec`` without the pool's generation, with quantities as numbers (the API server rewrites
    ``81920Mi`` as ``80Gi``)."""

    def normalise(value: Any, key: str = "") -> Any:
        if isinstance(value, Mapping):
            return {k: normalise(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [normalise(v) for v in value]
        if isinstance(value, str) and key in _QUANTITY_KEYS:
            return parse_quantity(value)
        return value

    pool = {k: v for k, v in (spec.get("pool") or {}).items() if k != "generation"}
    return normalise({**spec, "pool": pool})


def slice_current(live: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether the ``live`` slice already offers what ``desired`` does (the generation aside)."""
    return _comparable(live.get("spec") or {}) == _comparable(desired.get("spec") or {})


def device_changes(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> list[str]:
    """One phrase per device that ``desired`` adds, drops or changes compared with ``live``, in name order."""

    def devices(obj: Mapping[str, Any] | None) -> dict[str, Any]:
        spec = (obj or {}).get("spec") or {}
        return {d.get("name"): _comparable(d) for d in spec.get("devices") or []}

    before, after = devices(live), devices(desired)
    changes = []
    for name in sorted(before.keys() | after.keys(), key=str):
        if name not in before:
            changes.append(f"offers {name}")
        elif name not in after:
            changes.append(f"no longer offers {name}")
        elif before[name] != after[name]:
            changes.append(f"changes {name}")
    return changes
