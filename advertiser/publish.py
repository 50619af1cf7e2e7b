"""What the advertiser writes on its node, and whether anything needs writing. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpushare.cards import Card
from gpushare.contract.inventory import format_inventory, format_model_label
from gpushare.contract.names import NODE_ANN_INVENTORY, NODE_LABEL_MODEL
from gpushare.contract.units import MemoryUnit


def node_patch(node: Mapping[str, Any], cards: Sequence[Card], unit: MemoryUnit) -> dict[str, Any] | None:
    """The merge patch that brings ``node`` up to date with ``cards``, or None when it already is.

    The annotation is rewritten whole, so cards that disappeared drop out; the model label is removed
    when the node has no cards left.
    """
    meta = node.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    inventory = format_inventory(cards, unit)
    label = format_model_label(cards) if cards else None
    patch: dict[str, Any] = {}
    if annotations.get(NODE_ANN_INVENTORY) != inventory:
        patch.setdefault("metadata", {})["annotations"] = {NODE_ANN_INVENTORY: inventory}
    if labels.get(NODE_LABEL_MODEL) != label:
        patch.setdefault("metadata", {})["labels"] = {NODE_LABEL_MODEL: label}
    return patch or None
