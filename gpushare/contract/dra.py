"""The names of the cards in the node's ResourceSlice of the DRA driver ``gpu.gpushare.io``.

A card is ``card-<NVML index>``: claims' allocation results name the card this way, so the node agent
that prepares a claim finds the card from the device name alone.
"""

from __future__ import annotations

from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.names import DRA_DEVICE_PREFIX


class DraDeviceNameError(ContractError):
    """A device name that is not ``card-<NVML index>``."""


def format_dra_device(index: int) -> str:
    """The device name of the card with NVML index ``index``."""
    if index < 0:
        raise DraDeviceNameError(f"card index {index} is negative: no device name")
    return f"{DRA_DEVICE_PREFIX}{index}"


def parse_dra_device(name: str) -> int:
    """The NVML index the device ``name`` of :func:`format_dra_device` stands for."""
    digits = name.removeprefix(DRA_DEVICE_PREFIX)
    canonical = digits.isascii() and digits.isdigit() and (digits == "0" or not digits.startswith("0"))
    if digits == name or not canonical:
        raise DraDeviceNameError(f"device name {quoted(name)} is not {DRA_DEVICE_PREFIX}<NVML index>")
    return int(digits)
