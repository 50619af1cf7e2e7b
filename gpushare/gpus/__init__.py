"""The node's cards: the interface every source of cards offers (:mod:`gpushare.gpus.backend`), NVML
on a real node (:mod:`gpushare.gpus.nvml`) and simulated cards everywhere else
(:mod:`gpushare.gpus.simulated`). The annotation the cards are published in is
:mod:`gpushare.contract.inventory`."""

from __future__ import annotations

from gpushare.gpus.backend import DEFAULT_IGNORED_XIDS, DEFAULT_NVML_RECOVERY, GpuBackend, InventoryError
from gpushare.gpus.nvml import NvmlBackend
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.memlimits.cgroups import UNKNOWN_V1, CgroupLayout


def open_backend(
    gpus: str,
    node_name: str,
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS,
    nvml_recovery: float = DEFAULT_NVML_RECOVERY,
    layout: CgroupLayout = UNKNOWN_V1,
) -> GpuBackend:
    """``--gpus nvml`` or ``--gpus sim:SPEC``; ``layout``: the node's cgroups, where NVML's memory limits apply."""
    if gpus == "nvml":
        return NvmlBackend(ignored_xids, nvml_recovery, layout=layout)
    if gpus.startswith("sim:"):
        return SimulatedBackend(node_name, gpus[4:], ignored_xids)
    raise InventoryError(f"--gpus {gpus!r} is neither 'nvml' nor 'sim:SPEC'")
