"""The environment a GPU container receives for its cards."""

from __future__ import annotations

from collections.abc import Mapping

from gpushare.contract.allocation import CardSlice
from gpushare.contract.names import ENV_MEM_CONTAINER, ENV_MEM_DEV, ENV_MEM_IDX, ENV_MEM_POD, ENV_VISIBLE_DEVICES


def assigned_env(slices: tuple[CardSlice, ...], pod_mem: int, card_units: Mapping[str, int]) -> dict[str, str]:
    """The env a container receives for its cards (original gpushare variables included)."""
    return {
        ENV_VISIBLE_DEVICES: ",".join(s.uuid for s in slices),
        ENV_MEM_IDX: ",".join(str(s.index) for s in slices),
        ENV_MEM_POD: str(pod_mem),
        ENV_MEM_CONTAINER: str(sum(s.units for s in slices)),
        ENV_MEM_DEV: str(card_units.get(slices[0].uuid, 0)),
    }
