"""The device lists the plugin advertises to kubelet, one per resource.

Kubelet and kube-scheduler count devices, so each list is sized to what the resource measures:

- ``aliyun.com/gpu-mem``: one device per memory unit per card, so the count is the node's memory.
- ``aliyun.com/gpu-count``: several replicas per card, by default one per memory unit of the card.
  A container that takes gpu-count on a card also takes at least one unit of it (gpu-mem/gpu-count
  per card, or the whole card), so a node can never run out of gpu-count replicas before its
  cards run out of memory, and kube-scheduler's own resource fit never refuses a pod the cards
  can hold. Which cards a pod gets, that they are distinct, and that whole-card pods get empty cards
  to themselves is decided by the extender and enforced by Allocate, not by these counts.

Device IDs are ``<card UUID>-_-<n>`` in both lists, so every ID names its card. Every device
carries its card's health and NUMA node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpushare.cards import Card
from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import MemoryUnit, format_unit
from gpushare.pb import deviceplugin_pb2 as pb

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
#: gRPC's default maximum message size; kubelet drops a larger ListAndWatch message entirely
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: separates the card UUID from the unit or replica number in a device ID
ID_SEPARATOR = "-_-"
#: ``--count-replicas`` value meaning one gpu-count replica per memory unit of each card
REPLICAS_PER_UNIT = 0


class DeviceListTooLarge(ValueError):
    """A device list would not fit in one gRPC message."""


def device_id(uuid: str, number: int) -> str:
    return f"{uuid}{ID_SEPARATOR}{number}"


def card_of_device(device_id: str) -> str:
    return device_id.split(ID_SEPARATOR, 1)[0]


def count_replicas(card: Card, unit: MemoryUnit, configured: int = REPLICAS_PER_UNIT) -> int:
    """gpu-count replicas listed for ``card``: ``configured``, or one per memory unit (at least one)."""
    return configured if configured > 0 else max(1, unit.units_of(card.memory_mib))


def _topology(card: Card) -> pb.TopologyInfo | None:
    return None if card.numa_node is None else pb.TopologyInfo(nodes=[pb.NUMANode(ID=card.numa_node)])


def _device(device_id: str, card: Card) -> pb.Device:
    return pb.Device(ID=device_id, health=HEALTHY if card.healthy else UNHEALTHY, topology=_topology(card))


def _per_card(resource: str, unit: MemoryUnit, replicas: int) -> Callable[[Card], int]:
    if resource == RESOURCE_MEM:
        return lambda card: unit.units_of(card.memory_mib)
    return lambda card: count_replicas(card, unit, replicas)


def device_list(
    resource: str, cards: Sequence[Card], unit: MemoryUnit, replicas: int = REPLICAS_PER_UNIT
) -> pb.ListAndWatchResponse:
    """The whole list for ``resource``; ``replicas`` is ``--count-replicas`` (gpu-count only)."""
    per_card = _per_card(resource, unit, replicas)
    return pb.ListAndWatchResponse(
        devices=[_device(device_id(c.uuid, n), c) for c in cards for n in range(per_card(c))]
    )


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def message_size(
    cards: Sequence[Card], unit: MemoryUnit, resource: str = RESOURCE_MEM, replicas: int = REPLICAS_PER_UNIT
) -> int:
    """The byte size of the ListAndWatch message for ``resource``, without building it.

    Building one message per candidate unit would take seconds (and gigabytes) for MiB units on a
    large node, so the size is summed per run of device numbers with the same number of digits:
    their device entries all have the same encoded size.
    """
    per_card = _per_card(resource, unit, replicas)
    total = 0
    for card in cards:
        count, low = per_card(card), 0
        while low < count:
            high = min(count, max(10, low * 10))  # numbers in [low, high) have the same digit count
            entry = _device(device_id(card.uuid, high - 1), card).ByteSize()
            total += (high - low) * (1 + _varint_size(entry) + entry)
            low = high
    return total


#: block sizes offered when a unit is too fine: powers of two, then whole GiB
_BLOCK_SIZES = tuple(2**n for n in range(1, 11))


def fitting_unit(cards: Sequence[Card], unit: MemoryUnit) -> MemoryUnit | None:
    """The finest power-of-two block, coarser than ``unit``, whose gpu-mem list fits one message."""
    candidates = (MemoryUnit(mib) for mib in _BLOCK_SIZES if mib > unit.mib)
    return next((u for u in candidates if message_size(cards, u) <= MAX_MESSAGE_BYTES), None)


def check_message_size(cards: Sequence[Card], unit: MemoryUnit, replicas: int = REPLICAS_PER_UNIT) -> None:
    """Refuse settings whose device lists kubelet could not receive, naming a unit that would fit.

    Sized as if every card were unhealthy (the longest health string), so that a later health flip
    can't push a list that fitted at start-up over the limit.
    """
    cards = [card.with_health(False) for card in cards]
    limit = f"over gRPC's {MAX_MESSAGE_BYTES:,}-byte limit (kubelet would see no devices at all)"
    size = message_size(cards, unit)
    if size > MAX_MESSAGE_BYTES:
        fitting = fitting_unit(cards, unit)
        advice = f"use --memory-unit {format_unit(fitting)} or coarser" if fitting else "use a coarser --memory-unit"
        raise DeviceListTooLarge(
            f"{RESOURCE_MEM} in units of {format_unit(unit)} needs a {size:,}-byte ListAndWatch message, "
            f"{limit}; {advice}"
        )
    size = message_size(cards, unit, RESOURCE_COUNT, replicas)
    if size > MAX_MESSAGE_BYTES:
        per = f"{replicas} replicas per card" if replicas else "one replica per memory unit"
        raise DeviceListTooLarge(
            f"{RESOURCE_COUNT} with {per} needs a {size:,}-byte ListAndWatch message, "
            f"{limit}; use a smaller --count-replicas"
        )
