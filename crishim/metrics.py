"""Prometheus metrics of the CRI shim."""

from __future__ import annotations

from functools import cache, lru_cache

from prometheus_client import Counter, Histogram

from gpushare.pb import cri_pb2

CORRECTIONS = Counter(
    "gpushare_crishim_corrections_total",
    "CreateContainer requests whose GPU settings were corrected before forwarding",
    ["reason"],
)
REFUSALS = Counter(
    "gpushare_crishim_refusals_total",
    "CreateContainer and StartContainer requests refused with FAILED_PRECONDITION",
    ["reason"],
)
FORWARD_LATENCY = Histogram(
    "gpushare_crishim_forward_seconds",
    "Time from a call's request headers to the runtime's last frame for it, by method",
    ["method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0),
)
#: label for methods outside the CRI proto: their names come from clients, and labels must stay few
OTHER_METHOD = "other"


@cache
def _known_methods() -> frozenset[bytes]:
    return frozenset(
        f"/{service.full_name}/{method.name}".encode()
        for service in cri_pb2.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    )


def method_label(path: bytes | None) -> str:
    return path.decode() if path is not None and path in _known_methods() else OTHER_METHOD


@lru_cache(maxsize=256)
def call_timer(path: bytes | None) -> Histogram:
    """The latency histogram of ``path``'s label; looked up once per method, not once per call."""
    return FORWARD_LATENCY.labels(method_label(path))
