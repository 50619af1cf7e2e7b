"""Prometheus metrics of the device plugin."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import Counter, Gauge, Histogram

from gpushare.cards import Card
from gpushare.contract.units import MemoryUnit

ALLOCATE_LATENCY = Histogram(
    "gpushare_allocate_seconds",
    "Time to answer one Allocate container request, API patch included",
    ["resource"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
ALLOCATE_FAILURES = Counter("gpushare_allocate_failures_total", "Allocate requests refused", ["resource", "reason"])
#: every card series carries the card's model as NVML names it, to group or filter by it
CARD_LABELS = ["node", "card", "uuid", "model"]
CARD_ALLOCATED = Gauge("gpushare_card_allocated_units", "Units of the card held by live pods", CARD_LABELS)
CARD_TOTAL = Gauge("gpushare_card_total_units", "Units of the card", CARD_LABELS)
CARD_HEALTHY = Gauge("gpushare_card_healthy", "1 when the card is healthy", CARD_LABELS)
MEMORY_LIMITS = Gauge(
    "gpushare_memory_limits_enforced", "1 when the driver enforces each container's GPU memory share", CARD_LABELS
)


def publish_card_usage(node: str, cards: Sequence[Card], used: Mapping[str, int], unit: MemoryUnit) -> None:
    for card in cards:
        labels = {"node": node, "card": str(card.index), "uuid": card.uuid, "model": card.model}
        CARD_ALLOCATED.labels(**labels).set(used.get(card.uuid, 0))
        CARD_TOTAL.labels(**labels).set(unit.units_of(card.memory_mib))
        CARD_HEALTHY.labels(**labels).set(1 if card.healthy else 0)
        MEMORY_LIMITS.labels(**labels).set(1 if card.limits_enforced else 0)
