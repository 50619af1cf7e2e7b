"""Prometheus metrics of the CRI shim."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

CORRECTIONS = Counter(
    "gpushare_crishim_corrections_total",
    "CreateContainer requests whose GPU settings were corrected before forwarding",
    ["reason"],
)
REFUSALS = Counter(
    "gpushare_crishim_refusals_total",
    "CreateContainer requests refused with FAILED_PRECONDITION",
    ["reason"],
)
FORWARD_LATENCY = Histogram(
    "gpushare_crishim_forward_seconds",
    "Time from receiving a call to finishing it (runtime round trip included), by method",
    ["method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0),
)
