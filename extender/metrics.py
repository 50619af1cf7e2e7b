"""Prometheus metrics of the extender."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

VERB_LATENCY = Histogram(
    "gpushare_extender_verb_seconds",
    "Time to answer one extender call",
    ["verb"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
)
BIND_BATCH = Histogram(
    "gpushare_extender_bind_batch_size",
    "Binds onto one node recorded by one write of the node (those that waited for it together)",
    buckets=(1, 2, 4, 8, 16),
)
BIND_FAILURES = Counter("gpushare_extender_bind_failures_total", "Binds that failed", ["reason"])
CARD_ALLOCATED = Gauge(
    "gpushare_extender_card_allocated_units",
    "Units of the card held, as the extender sees it",
    ["node", "card", "model"],
)
CARD_TOTAL = Gauge("gpushare_extender_card_total_units", "Units of the card", ["node", "card", "model"])
