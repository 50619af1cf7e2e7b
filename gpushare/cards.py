"""The plain description of one GPU, shared by the inventory backends and the contract."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


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

    def with_health(self, healthy: bool) -> Card:
        return replace(self, healthy=healthy)
