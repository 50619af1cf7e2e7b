"""How the cards of a node appear to Dynamic Resource Allocation (driver ``gpu.gpushare.io``).

The one naming scheme shared by the ResourceSlice a node publishes and the kubelet plugin that
prepares claims allocated from it:

- one ResourceSlice pool per node, named after the node; one device per card, named
  ``card-<NVML index>`` (:func:`format_device_name`, :func:`parse_device_name`);
- device attributes ``uuid`` (string, ``GPU-...``), ``index`` (int, NVML index), ``minor`` (int,
  ``/dev/nvidia<minor>``), ``model`` (string) and ``numa`` (int, only when the card's NUMA node is
  known);
- capacity ``memory``: the card's size in bytes, with ``allowMultipleAllocations: true`` and a
  ``requestPolicy`` whose step (and minimum and default) is the node's memory unit, so that every
  allocation's ``consumedCapacity.memory`` is a whole number of units.
"""

from __future__ import annotations

import re

from gpushare.contract.errors import ContractError, quoted

DEVICE_PREFIX = "card-"
ATTR_UUID = "uuid"
ATTR_INDEX = "index"
ATTR_MINOR = "minor"
ATTR_MODEL = "model"
ATTR_NUMA = "numa"

_DEVICE_RE = re.compile(r"^card-(0|[1-9][0-9]{0,5})$")


def format_device_name(index: int) -> str:
    """The DRA device name of the card with NVML index ``index``."""
    if index < 0:
        raise ContractError(f"card index {index} is negative")
    return f"{DEVICE_PREFIX}{index}"


def parse_device_name(name: str) -> int:
    """The NVML index of the card a DRA device name denotes."""
    m = _DEVICE_RE.match(name) if isinstance(name, str) else None
    if not m:
        raise ContractError(f"device {quoted(name)} is not named card-<index>")
    return int(m.group(1))
