"""The environment a GPU container receives for its cards."""

from __future__ import annotations

from collections.abc import Mapping

from gpushare.contract.allocation import CardSlice
from gpushare.contract.names import (
    ENV_MEM_CONTAINER,
    ENV_MEM_DEV,
    ENV_MEM_IDX,
    ENV_MEM_POD,
    ENV_TOOLKIT_MEMORY_LIMIT,
    ENV_TOOLKIT_MEMORY_REQUEST,
    ENV_VISIBLE_DEVICES,
)


def assigned_env(slices: tuple[CardSlice, ...], pod_mem: int, card_units: Mapping[str, int]) -> dict[str, str]:
    """The env a container receives for its cards (original gpushare variables included)."""
    return {
        ENV_VISIBLE_DEVICES: ",".join(s.uuid for s in slices),
        ENV_MEM_IDX: ",".join(str(s.index) for s in slices),
        ENV_MEM_POD: str(pod_mem),
        ENV_MEM_CONTAINER: str(sum(s.units for s in slices)),
        ENV_MEM_DEV: str(card_units.get(slices[0].uuid, 0)),
    }


def toolkit_memory_env(slices: tuple[CardSlice, ...], unit_mib: int) -> dict[str, str]:
    """What NVIDIA's container toolkit hook ``apply-cuda-memory-limits`` is to read, where a node runs it
    (NVIDIA/nvidia-container-toolkit, cmd/nvidia-cdi-hook/apply-cuda-memory-limits): it sets the
    request and the limit, in MiB, as the soft and hard limits of the container's own cgroup on each of
    its cards, from the container's env, which its spec may set. gpushare sets the limits itself; these
    values make the hook set the same hard limit (one value for all cards: the smallest share) and no
    soft limit, which the runtime would remove with the cgroup before it could be given back."""
    limit = str(min(part.units for part in slices) * unit_mib)
    return {key: "0" for key in ENV_TOOLKIT_MEMORY_REQUEST} | dict.fromkeys(ENV_TOOLKIT_MEMORY_LIMIT, limit)
