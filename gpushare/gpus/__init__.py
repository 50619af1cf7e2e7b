"""The node's cards: the interface every source of cards offers (:mod:`gpushare.gpus.backend`), NVML
on a real node (:mod:`gpushare.gpus.nvml`) and simulated cards everywhere else
(:mod:`gpushare.gpus.simulated`). The annotation the cards are published in is
:mod:`gpushare.contract.inventory`."""

from __future__ import annotations

from gpushare.gpus.backend import DEFAULT_IGNORED_XIDS, DEFAULT_NVML_RECOVERY, GpuBackend, InventoryError
from gpushare.gpus.nvml import NvmlBackend
from gpushare.gpus.simulated import SimulatedBackend


def open_backend(
    gpus: str,
    node_name: str,
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS,
    nvml_recovery: float = DEFAULT_NVML_RECOVERY,
) -> GpuBackend:
    """``--gpus nvml`` or ``--gpus sim:SPEC``."""
    if gpus == "nvml":
        return NvmlBackend(ignored_xids, nvml_recovery)
    if gpus.startswith("sim:"):
        return SimulatedBackend(node_name, gpus[4:], ignored_xids)
    raise InventoryError(f"--gpus {gpus!r} is neither 'nvml' nor 'sim:SPEC'")
