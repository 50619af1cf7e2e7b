"""What a pod's GPU memory limits are, per card it holds a share of, and where they go (NVIDIA's
`MPS v3 Memory Partitioning <https://docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html>`_:
the hard limit is the most a cgroup may allocate, the soft limit memory guaranteed to it).

- **The pod's cgroup** gets a hard limit of the pod's share (what :func:`gpushare.holdings.pod.pod_cards` says
  it holds there: its containers' sum, or its largest init container when that is more; plus what its
  ResourceClaims were allocated there) and the pod's soft limit. Kubelet makes the pod's cgroup before
  any of its containers, and gpushare sees its end (the sandbox's stop), so the soft limit, a
  reservation the driver also makes on the cgroup's ancestors, is given back before the cgroup goes.
- **Each GPU container's own cgroup** gets a hard limit of the container's share and no soft limit.
  The driver's kernel backend (``dmem``) is hierarchical, so the pod's hard limit already holds its
  containers; its fallback backend (``misc``, kernels before 6.14) is not documented to be, and NVIDIA's
  tools set limits on the cgroup the process runs in. The container's limit holds it under both, and
  makes the memory it sees (``cuMemGetInfo``) its own share, as ``ALIYUN_COM_GPU_MEM_CONTAINER`` says.
  The runtime removes a container's cgroup when the container exits, without a word to gpushare, so a
  soft limit there could not be given back first: it gets none.

The soft limit is the pod's share of what the card can guarantee: the card less what the driver keeps
for itself (:attr:`gpushare.cards.Card.reserved_mib`), in proportion, rounded down to a MiB. The extender
never places more than a card's memory on it, so the soft limits on a card add up to at most what it
can guarantee. A pod that holds a whole card gets no limit on it: nobody shares it. Pure: plain values
in, limits out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpushare.cards import Card
from gpushare.contract.units import MIB_BYTES, MemoryUnit


@dataclass(frozen=True, slots=True)
class Limit:
    """One card's limits for one cgroup, in bytes."""

    index: int
    uuid: str
    soft_bytes: int
    hard_bytes: int

    def __str__(self) -> str:
        return f"card {self.index} ({self.uuid}) {self.hard_bytes // MIB_BYTES} MiB"


def guaranteed_bytes(share_bytes: int, card: Card) -> int:
    """The soft limit of a pod holding ``share_bytes`` of ``card``: that share of what the card can
    guarantee (its memory less what the driver reserves), rounded down to a MiB."""
    total = card.memory_mib
    return share_bytes * (total - card.reserved_mib) // total // MIB_BYTES * MIB_BYTES


def _shared(held: Mapping[str, int], cards: Sequence[Card], unit: MemoryUnit) -> list[tuple[Card, int]]:
    """(card, bytes) for each card ``held`` has a share of, short of the whole card, in card order; a
    card not among ``cards`` is an error (the assignment was checked against them already)."""
    by_uuid = {c.uuid: c for c in cards}
    if lacking := sorted(set(held) - set(by_uuid)):
        raise ValueError(f"card(s) {', '.join(lacking)} are not on this node")
    shared = []
    for card in sorted((by_uuid[uuid] for uuid in held), key=lambda c: c.index):
        units = held[card.uuid]
        if 0 < units < unit.units_of(card.memory_mib):
            shared.append((card, units * unit.bytes))
    return shared


def pod_limits(held: Mapping[str, int], cards: Sequence[Card], unit: MemoryUnit) -> tuple[Limit, ...]:
    """The limits of the cgroup of a pod holding ``held`` units per card UUID on a node with ``cards``."""
    return tuple(
        Limit(card.index, card.uuid, soft_bytes=guaranteed_bytes(share, card), hard_bytes=share)
        for card, share in _shared(held, cards, unit)
    )


def container_limits(held: Mapping[str, int], cards: Sequence[Card], unit: MemoryUnit) -> tuple[Limit, ...]:
    """The limits of the cgroup of a container given ``held`` units per card UUID: hard only."""
    return tuple(
        Limit(card.index, card.uuid, soft_bytes=0, hard_bytes=share) for card, share in _shared(held, cards, unit)
    )
