"""The plain description of one GPU, shared by the inventory backends and the contract."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

#: :attr:`Card.memory_limits` of a card whose driver holds each container to its share
ENFORCED = "enforced"
#: :attr:`Card.memory_limits` of a card whose node agent didn't say (one older than memory limits)
NOT_REPORTED = "not reported by the node agent"


@dataclass(frozen=True, slots=True)
class Card:
    """One GPU as the node sees it.

    ``index`` is the NVML index; ``minor`` is the /dev/nvidia<minor> number. The two can differ, so
    nothing may use one in place of the other. Cards are identified by ``uuid`` everywhere.
    """

    index: int
    uuid: str
    model: str
    memory_mib: int
    minor: int
    numa_node: int | None = None
    nvlink_peers: tuple[str, ...] = field(default_factory=tuple)
    healthy: bool = True
    #: :data:`ENFORCED` when the NVIDIA driver caps each container at its share of this card
    #: (per-cgroup memory limits, driver 615+ on cgroup v2), else why it doesn't
    memory_limits: str = NOT_REPORTED
    #: what the driver keeps of the card for itself (NVML's ``nvmlMemory_v2_t.reserved``, "reserved for
    #: system use (driver or firmware)"): no cgroup can be guaranteed it
    reserved_mib: int = 0

    @property
    def limits_enforced(self) -> bool:
        return self.memory_limits == ENFORCED

    def with_health(self, healthy: bool) -> Card:
        return replace(self, healthy=healthy)
