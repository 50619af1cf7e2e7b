"""What a pod's GPU memory limits are: per card it holds a share of, a hard limit of that share (what
:func:`gpushare.usage.pod_cards` says the pod holds there: its containers' sum, or its largest init
container when that is more; plus what :func:`gpushare.usage.dra_held` says its ResourceClaims were
allocated there), and a soft limit equal to it.

The limits go on the pod's cgroup, not on each container's: kubelet makes the pod's cgroup before any
of its containers, under either cgroup driver, while a container's cgroup is made by the runtime in the
very call that starts the container's process, so nothing could set a container's limit before its
process runs. The driver counts a container's allocations against its pod's cgroup, so the pod can't
use more than the scheduler reserved for it on the card; its containers share that reservation, as
they share the pod's memory limit.

The soft limit is what the driver guarantees before allocations may fail under memory pressure. The
extender never places more on a card than it has, so the hard limits on a card add up to at most the
card: guaranteeing each pod its whole share costs nothing, and a lower soft limit would let a
neighbour's pressure fail allocations inside a pod's own share. A pod that holds a whole card gets no
limit on it: nobody shares it. Pure: plain values in, limits out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpushare.cards import Card
from gpushare.contract.units import MIB_BYTES, MemoryUnit


@dataclass(frozen=True, slots=True)
class Limit:
    """One card's limits for one pod's cgroup, in bytes."""

    index: int
    uuid: str
    soft_bytes: int
    hard_bytes: int

    def __str__(self) -> str:
        return f"card {self.index} ({self.uuid}) {self.hard_bytes // MIB_BYTES} MiB"


def pod_limits(held: Mapping[str, int], cards: Sequence[Card], unit: MemoryUnit) -> tuple[Limit, ...]:
    """The limits of a pod holding ``held`` units per card UUID on a node with ``cards``, in card
    order; a card not among ``cards`` is an error (the assignment was checked against them already)."""
    by_uuid = {c.uuid: c for c in cards}
    if lacking := sorted(set(held) - set(by_uuid)):
        raise ValueError(f"card(s) {', '.join(lacking)} are not on this node")
    limits = []
    for card in sorted((by_uuid[uuid] for uuid in held), key=lambda c: c.index):
        units = held[card.uuid]
        if units <= 0 or units >= unit.units_of(card.memory_mib):
            continue
        share = units * unit.bytes
        limits.append(Limit(card.index, card.uuid, soft_bytes=share, hard_bytes=share))
    return tuple(limits)
