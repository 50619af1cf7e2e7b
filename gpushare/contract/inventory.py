"""The codec of the node's inventory annotation, which the advertiser writes and the extender, the
device plugin and inspect read, and of the card-model label. (Where the cards come from is
:mod:`gpushare.gpus`.)"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpushare.cards import NOT_REPORTED, Card
from gpushare.contract.errors import AnnotationError, ContractError, json_object, quoted
from gpushare.contract.names import NODE_ANN_INVENTORY
from gpushare.contract.units import CARDS_LIMIT, UNITS_LIMIT, MemoryUnit, bounded, format_unit, parse_unit

INVENTORY_VERSION = 1


@dataclass(frozen=True, slots=True)
class NodeInventory:
    unit: MemoryUnit
    cards: tuple[Card, ...]
    #: set when the cards were inferred from the node's status (no inventory annotation): how
    inferred: str | None = None

    def units_of(self, card: Card) -> int:
        return self.unit.units_of(card.memory_mib)


def format_inventory(cards: Iterable[Card], unit: MemoryUnit) -> str:
    return json.dumps(
        {
            "version": INVENTORY_VERSION,
            "unit": format_unit(unit),
            "unitMiB": unit.mib,
            "cards": [
                {
                    "index": c.index,
                    "uuid": c.uuid,
                    "model": c.model,
                    "memoryMiB": c.memory_mib,
                    "units": unit.units_of(c.memory_mib),
                    "minor": c.minor,
                    "numa": c.numa_node,
                    "nvlinkPeers": list(c.nvlink_peers),
                    "healthy": c.healthy,
                    "memoryLimits": c.memory_limits,
                    "reservedMiB": c.reserved_mib,
                }
                for c in sorted(cards, key=lambda c: c.index)
            ],
        },
        separators=(",", ":"),
    )


def _inventory_card(node: str, raw: Any) -> Card:
    where = f"node {node} annotation {NODE_ANN_INVENTORY}"
    if not isinstance(raw, dict):
        raise AnnotationError(f"{where}: card entry {quoted(raw)} is not an object")
    try:
        card = Card(
            index=int(raw["index"]),
            uuid=str(raw["uuid"]),
            model=str(raw.get("model", "")),
            memory_mib=int(raw["memoryMiB"]),
            minor=int(raw["minor"]),
            numa_node=None if raw.get("numa") is None else int(raw["numa"]),
            nvlink_peers=tuple(str(p) for p in raw.get("nvlinkPeers") or ()),
            healthy=bool(raw.get("healthy", True)),
            memory_limits=str(raw.get("memoryLimits", NOT_REPORTED)),
            reserved_mib=int(raw.get("reservedMiB", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise AnnotationError(f"{where}: card entry {quoted(raw)} is missing or has a bad field ({exc})") from None
    if not card.memory_limits.strip():
        raise AnnotationError(f"{where}: card entry {quoted(raw)} has an empty memoryLimits")
    if not card.uuid.startswith("GPU-") or card.index < 0 or card.memory_mib <= 0:
        raise AnnotationError(f"{where}: card entry {quoted(raw)} has an invalid uuid, index or memory")
    bounded(card.memory_mib, UNITS_LIMIT, f"{where}: card {card.index} memoryMiB")
    if not 0 <= card.reserved_mib < card.memory_mib:
        raise AnnotationError(f"{where}: card {card.index} reservedMiB {card.reserved_mib} is not within its memoryMiB")
    for field, number in (("index", card.index), ("minor", card.minor), ("numa", card.numa_node or 0)):
        bounded(number, CARDS_LIMIT, f"{where}: card {card.index} {field}", low=-CARDS_LIMIT)
    return card


def parse_inventory(text: str, node: str = "?") -> NodeInventory:
    where = f"node {node} annotation {NODE_ANN_INVENTORY}"
    raw = json_object(text, where, f"an object with version {INVENTORY_VERSION}")
    if raw.get("version") != INVENTORY_VERSION:
        raise AnnotationError(f"{where}: expected an object with version {INVENTORY_VERSION}")
    try:
        unit = parse_unit(str(raw.get("unit", "")))
    except ContractError as exc:
        raise AnnotationError(f"{where}: {exc}") from None
    listed = raw.get("cards") or []
    bounded(len(listed), CARDS_LIMIT, f"{where}: the number of cards")
    cards = tuple(_inventory_card(node, c) for c in listed)
    if len({c.uuid for c in cards}) != len(cards) or len({c.index for c in cards}) != len(cards):
        raise AnnotationError(f"{where}: the same card index or uuid appears twice")
    return NodeInventory(unit=unit, cards=tuple(sorted(cards, key=lambda c: c.index)))


def format_model_label(cards: Iterable[Card]) -> str:
    """Label value naming the node's card model(s): sanitised to the label charset, joined by '_'."""
    models = sorted({re.sub(r"[^A-Za-z0-9._-]", "-", c.model).strip("-._") or "unknown" for c in cards})
    return "_".join(models)[:63].strip("-._")
