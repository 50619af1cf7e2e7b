"""How the cards of a node appear to Dynamic Resource Allocation (driver ``gpu.gpushare.io``).

The one naming scheme shared by the ResourceSlice a node publishes and the kubelet plugin that
prepares claims allocated from it:

- one ResourceSlice pool per node, named after the node; one device per card, named
  ``card-<NVML index>`` (:func:`format_device_name`, :func:`parse_device_name`), so the node agent that
  prepares a claim finds the card from the device name alone;
- device attributes ``uuid`` (string, ``GPU-...``), ``index`` (int, NVML index), ``minor`` (int,
  ``/dev/nvidia<minor>``), ``model`` (string), ``numa`` (int, only when the card's NUMA node is known)
  and ``nvlinkClique`` (see :mod:`gpushare.contract.names`);
- capacity ``memory``: the card's size in bytes, with ``allowMultipleAllocations: true`` and a
  ``requestPolicy`` whose step (and minimum and default) is the node's memory unit, so that every
  allocation's ``consumedCapacity.memory`` is a whole number of units;
- a prepared claim's containers get CDI devices of kind ``gpu.gpushare.io/claim``, one per request,
  named ``<claim UID>-<request>`` (:func:`format_claim_cdi_device`, :func:`parse_claim_cdi_device`;
  :func:`claim_cdi_devices` finds them in what kubelet hands the runtime).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.names import CDI_ANNOTATION_PREFIX, DRA_CDI_ENV_PREFIX, DRA_CDI_KIND, DRA_DEVICE_PREFIX
from gpushare.contract.units import HOST_LIMIT


class DraDeviceNameError(ContractError):
    """A device name that is not ``card-<NVML index>``."""


class DraMemoryError(ContractError):
    """A ``memory`` quantity (a device's capacity, a claim's consumption) that is not whole bytes."""


def format_device_name(index: int) -> str:
    """The DRA device name of the card with NVML index ``index``."""
    if index < 0:
        raise DraDeviceNameError(f"card index {index} is negative: no device name")
    return f"{DRA_DEVICE_PREFIX}{index}"


def parse_device_name(name: str) -> int:
    """The NVML index of the card a DRA device name (:func:`format_device_name`) stands for."""
    digits = name.removeprefix(DRA_DEVICE_PREFIX) if isinstance(name, str) else ""
    canonical = digits.isascii() and digits.isdigit() and (digits == "0" or not digits.startswith("0"))
    if digits == name or not canonical:
        raise DraDeviceNameError(f"device name {quoted(name)} is not {DRA_DEVICE_PREFIX}<NVML index>")
    return int(digits)


def format_claim_cdi_device(uid: str, request: str) -> str:
    """The fully qualified CDI device kubelet hands the runtime for request ``request`` of the claim with
    UID ``uid``."""
    return f"{DRA_CDI_KIND}={uid}-{request}"


def parse_claim_cdi_device(device: str, uids: Iterable[str]) -> tuple[str, str] | None:
    """(claim UID, request) of a CDI device of :func:`format_claim_cdi_device`, for the claim among
    ``uids`` it names; None when it names none of them (or is of another kind). Claim UIDs are UUIDs of
    one length, so at most one of them prefixes the name."""
    name = device.removeprefix(f"{DRA_CDI_KIND}=")
    if name == device:
        return None
    for uid in uids:
        request = name.removeprefix(f"{uid}-")
        if uid and request != name and request:
            return uid, request
    return None


def format_claim_env_key(uid: str, request: str) -> str:
    """The variable a claim's CDI device sets for ``request`` (request names are DNS labels)."""
    return f"{DRA_CDI_ENV_PREFIX}{uid}_{request}".upper().replace("-", "_")


#: the length of a claim UID (a UUID, as the API server assigns them)
CLAIM_UID_LENGTH = 36


def parse_claim_env_key(key: str) -> str | None:
    """The CDI device (:func:`format_claim_cdi_device`) whose spec sets the variable ``key``
    (:func:`format_claim_env_key`); None for any other variable. The mapping inverts: a claim UID is a
    UUID (fixed length, lower-case hex and ``-``) and a request name a DNS label (lower case, digits and
    ``-``), so upper case and ``_`` stand for lower case and ``-`` in both."""
    rest = key.removeprefix(DRA_CDI_ENV_PREFIX)
    uid, after = rest[:CLAIM_UID_LENGTH], rest[CLAIM_UID_LENGTH:]
    request = after.removeprefix("_")
    if rest == key or request == after or not request:
        return None
    return format_claim_cdi_device(uid.lower().replace("_", "-"), request.lower().replace("_", "-"))


def claim_env_devices(keys: Iterable[str]) -> tuple[str, ...]:
    """The CDI devices of prepared claims whose specs set one of the variables ``keys``, each once, in
    order: what shows that such a device was applied to a container once its CDI edits are (the env
    NRI shows a plugin; containerd 2.2 doesn't fill NRI's ``Container.CDI_devices``)."""
    return tuple(dict.fromkeys(d for d in map(parse_claim_env_key, keys) if d is not None))


def format_card_memory(held: Mapping[str, int]) -> str:
    """``<card UUID>=<bytes>,...`` (sorted by UUID): what a prepared claim holds on each card."""
    return ",".join(f"{uuid}={amount}" for uuid, amount in sorted(held.items()))


def parse_card_memory(text: Any, where: str) -> dict[str, int]:
    """The inverse of :func:`format_card_memory`; :class:`DraMemoryError` naming ``where`` when ``text``
    is not that."""
    if not isinstance(text, str) or not text:
        raise DraMemoryError(f"{where}: {quoted(text)} is not <card UUID>=<bytes>,...")
    held: dict[str, int] = {}
    for part in text.split(","):
        uuid, _, amount = part.partition("=")
        digits = amount.isascii() and amount.isdigit() and len(amount) <= len(str(HOST_LIMIT))
        if not uuid or uuid in held or not digits or not 0 < int(amount) <= HOST_LIMIT:
            raise DraMemoryError(f"{where}: {quoted(part)} is not <card UUID>=<positive bytes>, once per card")
        held[uuid] = int(amount)
    return held


def claim_cdi_devices(cdi_devices: Iterable[str], annotations: Mapping[str, str]) -> tuple[str, ...]:
    """The CDI devices of kind ``gpu.gpushare.io/claim`` among a container's CDI devices and its CDI
    annotations (``cdi.k8s.io/...``, comma-separated), the two places containerd applies them from;
    each once, in that order."""
    annotated = (
        name.strip()
        for key, value in sorted(annotations.items())
        if key.startswith(CDI_ANNOTATION_PREFIX)
        for name in value.split(",")
    )
    ours = (name for name in (*cdi_devices, *annotated) if name.startswith(f"{DRA_CDI_KIND}="))
    return tuple(dict.fromkeys(ours))


def parse_memory_bytes(raw: Any) -> int:
    """A ``memory`` quantity as the API server writes it (``80Gi``, ``8589934592``) in bytes; a positive
    whole number of them, else :class:`DraMemoryError`."""
    try:
        amount = parse_quantity(raw) if isinstance(raw, str | int) and not isinstance(raw, bool) else None
    except ValueError:
        amount = None
    if amount is not None and amount.is_finite() and amount > HOST_LIMIT:
        raise DraMemoryError(f"{quoted(raw)} is more than the {HOST_LIMIT} bytes allowed")
    if amount is None or not amount.is_finite() or amount != amount.to_integral_value() or amount <= 0:
        raise DraMemoryError(f"{quoted(raw)} is not a positive whole number of bytes")
    return int(Decimal(amount))
