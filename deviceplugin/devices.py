"""The device lists the plugin advertises to kubelet, one per resource.

``aliyun.com/gpu-mem`` lists one device per memory unit per card (kubelet counts devices, so the
count is the node's memory in units); ``aliyun.com/gpu-count`` lists one device per card, named by
the card's UUID. Both carry each card's health and NUMA node.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.cards import Card
from gpushare.contract import RESOURCE_MEM, MemoryUnit, format_unit
from gpushare.pb import deviceplugin_pb2 as pb

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
#: gRPC's default maximum message size; kubelet drops a larger ListAndWatch message entirely
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: separates the card UUID from the unit number in a gpu-mem device ID
MEM_ID_SEPARATOR = "-_-"


class DeviceListTooLarge(ValueError):
    """The gpu-mem device list would not fit in one gRPC message."""


def mem_device_id(uuid: str, unit_number: int) -> str:
    return f"{uuid}{MEM_ID_SEPARATOR}{unit_number}"


def card_of_mem_device(device_id: str) -> str:
    return device_id.split(MEM_ID_SEPARATOR, 1)[0]


def _topology(card: Card) -> pb.TopologyInfo | None:
    return None if card.numa_node is None else pb.TopologyInfo(nodes=[pb.NUMANode(ID=card.numa_node)])


def _device(device_id: str, card: Card) -> pb.Device:
    return pb.Device(ID=device_id, health=HEALTHY if card.healthy else UNHEALTHY, topology=_topology(card))


def mem_devices(cards: Sequence[Card], unit: MemoryUnit) -> list[pb.Device]:
    return [_device(mem_device_id(card.uuid, n), card) for card in cards for n in range(unit.units_of(card.memory_mib))]


def count_devices(cards: Sequence[Card]) -> list[pb.Device]:
    return [_device(card.uuid, card) for card in cards]


def device_list(resource: str, cards: Sequence[Card], unit: MemoryUnit) -> pb.ListAndWatchResponse:
    devices = mem_devices(cards, unit) if resource == RESOURCE_MEM else count_devices(cards)
    return pb.ListAndWatchResponse(devices=devices)


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def message_size(cards: Sequence[Card], unit: MemoryUnit) -> int:
    """The byte size of the gpu-mem ListAndWatch message, without building it.

    Building one message per candidate unit would take seconds (and gigabytes) for MiB units on a
    large node, so the size is summed per run of unit numbers with the same number of digits: their
    device entries all have the same encoded size.
    """
    total = 0
    for card in cards:
        units, low = unit.units_of(card.memory_mib), 0
        while low < units:
            high = min(units, max(10, low * 10))  # unit numbers in [low, high) have the same digit count
            entry = _device(mem_device_id(card.uuid, high - 1), card).ByteSize()
            total += (high - low) * (1 + _varint_size(entry) + entry)
            low = high
    return total


#: block sizes offered when a unit is too fine: powers of two, then whole GiB
_BLOCK_SIZES = tuple(2**n for n in range(1, 11))


def fitting_unit(cards: Sequence[Card], unit: MemoryUnit) -> MemoryUnit | None:
    """The finest power-of-two block, coarser than ``unit``, whose gpu-mem list fits one message."""
    candidates = (MemoryUnit(mib) for mib in _BLOCK_SIZES if mib > unit.mib)
    return next((u for u in candidates if message_size(cards, u) <= MAX_MESSAGE_BYTES), None)


def check_message_size(cards: Sequence[Card], unit: MemoryUnit) -> None:
    """Refuse a unit whose gpu-mem list kubelet could not receive, naming a unit that would fit.

    Sized as if every card were unhealthy (the longest health string), so that a later health flip
    can't push a list that fitted at start-up over the limit.
    """
    cards = [card.with_health(False) for card in cards]
    size = message_size(cards, unit)
    if size <= MAX_MESSAGE_BYTES:
        return
    fitting = fitting_unit(cards, unit)
    advice = f"use --memory-unit {format_unit(fitting)} or coarser" if fitting else "use a coarser --memory-unit"
    raise DeviceListTooLarge(
        f"{RESOURCE_MEM} in units of {format_unit(unit)} needs a {size:,}-byte ListAndWatch message, over "
        f"gRPC's {MAX_MESSAGE_BYTES:,}-byte limit (kubelet would see no devices at all); {advice}"
    )
