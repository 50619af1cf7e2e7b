"""What every node-side command does around what it runs: open the node's cards, serve /metrics,
/healthz and /readyz, run until SIGTERM, and stop all it started on every way out."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from gpushare.gpus import open_backend
from gpushare.gpus.backend import GpuBackend
from gpushare.memlimits.cgroups import UNKNOWN_V1
from gpushare.observability import serve_http
from gpushare.process import wait_for_termination
from gpushare.settings import MetricsEndpoint, NodeSettings

log = logging.getLogger(__name__)


class Running(Protocol):
    def ready(self) -> bool: ...

    def stop(self) -> None: ...


def open_cards(settings: NodeSettings) -> GpuBackend:
    """The cards ``--gpus`` names, read through NVML or simulated."""
    layout = settings.cgroup_layout() if settings.gpus == "nvml" else UNKNOWN_V1
    return open_backend(settings.gpus, settings.node_name, settings.ignored_xids, settings.nvml_recovery, layout)


def run_on_node(
    what: str, settings: NodeSettings, metrics: MetricsEndpoint | None, start: Callable[[GpuBackend], Running]
) -> int:
    """Run ``start(cards)`` until SIGTERM, its readiness on ``metrics`` (unless off)."""
    with contextlib.ExitStack() as started:
        backend = open_cards(settings)
        started.callback(backend.close)
        running = start(backend)
        started.callback(running.stop)
        started.callback(log.info, "%s for node %s stopping", what, settings.node_name)
        if metrics is not None:
            started.callback(serve_http(metrics, running.ready).stop)
        wait_for_termination()
    return 0
