"""Trace pods on a real kube-scheduler, asked for through gpushare's extender or through DRA (driver
``gpu.gpushare.io``), and what each placement leaves on the cards. Pure: ``benchmarks/dra_replay.py``
creates the objects and reads them back.

**Asks.** A trace pod asks for a share of one card (``gpu_milli`` below 1000) or for whole cards. A share
becomes GiB of a reference card of ``card_gib`` (rounded up to a whole GiB): the trace gives shares of
whatever card the pod ran on, while a request in GiB names one amount. Whole cards stay whole cards of
any size, each empty when taken. The trace's ``gpu_spec`` names openb's models, which the replayed
nodes don't have, so it is not carried over.

**The extender's way**, as users write it: ``aliyun.com/gpu-mem: <GiB>`` for a share,
``aliyun.com/gpu-count: N`` alone for N whole cards, both (gpu-mem N x GiB) for a share on each of N cards.

**The DRA way**: a ResourceClaim of the DeviceClass ``gpu.gpushare.io``. A share is an ``exactly``
request with ``capacity.requests.memory: <GiB>Gi`` (``count: N`` for N cards: the allocator never gives
one request the same device twice). A claim can't ask for "all of a card, whatever its size", so a
whole-card claim lists one ``firstAvailable`` subrequest per card size of the cluster, smallest first
(or largest first), each selecting the cards of exactly that size and asking for all their memory, which
no other share can then take. kube-scheduler scores a node by how early a subrequest it could satisfy
there, so such a pod prefers the smallest (largest) cards that do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.cards import Card
from gpushare.contract.errors import ContractError
from gpushare.contract.names import DRA_CAPACITY_MEMORY, DRA_DRIVER, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.resourceclaim import ClaimRef, claim_allocation
from gpushare.contract.units import GIB
from gpushare.holdings.node import node_inventory, node_ledger, node_usage
from gpushare.simulate.replay import arrival_order
from gpushare.simulate.trace import MILLI_PER_CARD, TracePod

GIB_BYTES = GIB.bytes
#: the claim's one request, which the pod's container names
CLAIM_REQUEST = "gpu"
#: the most ``firstAvailable`` subrequests one request may list (resource.k8s.io/v1)
MAX_SUBREQUESTS = 8


class ReplayError(ValueError):
    """Settings, a trace or a placement the comparison can't use; the message says which and why."""


@dataclass(frozen=True, slots=True)
class GpuAsk:
    """One trace pod's GPU request: ``gib`` GiB on each of ``cards`` cards, or (``gib`` 0) ``cards``
    whole cards."""

    pod: str
    cards: int
    gib: int = 0

    @property
    def whole(self) -> bool:
        return self.gib == 0

    def rank(self) -> tuple[int, int]:
        """What one of its cards needs, smallest first: any share before a whole card."""
        return (1, 0) if self.whole else (0, self.gib)

    def __str__(self) -> str:
        if self.whole:
            return f"{self.cards} whole card(s)"
        return f"{self.gib} GiB" if self.cards == 1 else f"{self.cards} x {self.gib} GiB"


def gpu_ask(pod: TracePod, card_gib: int) -> GpuAsk:
    """``pod``'s request; its share of a card as GiB of a ``card_gib`` card."""
    if not pod.num_gpu:
        raise ReplayError(f"pod {pod.name} (line {pod.line}) asks for no GPU")
    if pod.gpu_milli >= MILLI_PER_CARD:
        return GpuAsk(pod.name, pod.num_gpu)
    return GpuAsk(pod.name, pod.num_gpu, max(1, math.ceil(pod.gpu_milli * card_gib / MILLI_PER_CARD)))


def arrivals(pods: Sequence[TracePod], count: int, seed: int, card_gib: int) -> list[GpuAsk]:
    """The first ``count`` GPU pods of a trace in the FGD paper's arrival order for ``seed`` (sorted by
    name, then shuffled), as asks."""
    if count < 1 or card_gib < 1:
        raise ReplayError(f"need at least one pod and a reference card of at least 1 GiB, not {count} and {card_gib}")
    gpu = [p for p in pods if p.num_gpu]
    if len(gpu) < count:
        raise ReplayError(f"the trace has {len(gpu)} GPU pods, fewer than the {count} asked for")
    # no capacity target: the trace alone is the arrival order, without the paper's clones
    return [gpu_ask(p, card_gib) for p in arrival_order(gpu, seed, 0)[:count]]


def extender_limits(ask: GpuAsk) -> dict[str, str]:
    """The gpushare resources a user writes in ``resources.limits`` for ``ask``."""
    if ask.whole:
        return {RESOURCE_COUNT: str(ask.cards)}
    limits = {RESOURCE_MEM: str(ask.gib * ask.cards)}
    if ask.cards > 1:
        limits[RESOURCE_COUNT] = str(ask.cards)
    return limits


def _memory(gib: int) -> dict[str, Any]:
    return {"requests": {DRA_CAPACITY_MEMORY: f"{gib}Gi"}}


def dra_claim_spec(ask: GpuAsk, card_sizes: Iterable[int], largest_first: bool = False) -> dict[str, Any]:
    """The ResourceClaim ``spec`` for ``ask``; ``card_sizes`` are the GiB of the cluster's cards (a
    whole-card claim names each size, smallest first unless ``largest_first``)."""
    if not ask.whole:
        exactly: dict[str, Any] = {"deviceClassName": DRA_DRIVER, "capacity": _memory(ask.gib)}
        if ask.cards > 1:
            exactly.update(allocationMode="ExactCount", count=ask.cards)
        return {"devices": {"requests": [{"name": CLAIM_REQUEST, "exactly": exactly}]}}
    sizes = sorted(set(card_sizes), reverse=largest_first)
    if not sizes or len(sizes) > MAX_SUBREQUESTS:
        raise ReplayError(
            f"pod {ask.pod}: a whole-card claim lists one subrequest per card size, and the cluster has "
            f"{len(sizes)} sizes (1 to {MAX_SUBREQUESTS} fit)"
        )
    capacity = f'device.capacity["{DRA_DRIVER}"].{DRA_CAPACITY_MEMORY}'
    subrequests = [
        {
            "name": f"whole-{size}gi",
            "deviceClassName": DRA_DRIVER,
            "allocationMode": "ExactCount",
            "count": ask.cards,
            "selectors": [{"cel": {"expression": f'{capacity}.compareTo(quantity("{size}Gi")) == 0'}}],
            "capacity": _memory(size),
        }
        for size in sizes
    ]
    return {"devices": {"requests": [{"name": CLAIM_REQUEST, "firstAvailable": subrequests}]}}


# --- what a placement left on the cards -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Share:
    """``gib`` GiB of card ``index`` of ``node``, held by one pod."""

    node: str
    index: int
    gib: int


def extender_shares(nodes: Iterable[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]) -> dict[str, list[Share]]:
    """Per pod name, what it holds on each card by the extender's record (:func:`gpushare.holdings.node.node_usage`,
    the node's ledger first, then the pod's annotations), in GiB."""
    held: dict[str, list[Share]] = {}
    for node in nodes:
        name = node["metadata"]["name"]
        inventory = node_inventory(node)
        if inventory.unit != GIB:
            raise ReplayError(f"node {name}: gpu-mem unit {inventory.unit.name}, the replay counts GiB")
        index = {card.uuid: card.index for card in inventory.cards}
        on_node = [p for p in pods if (p.get("spec") or {}).get("nodeName") == name]
        _, counted, bad = node_usage(on_node, inventory, ledger=node_ledger(node))
        if bad:
            raise ReplayError(f"node {name}: {bad[0].reason}")
        for pod in counted:
            shares = held.setdefault(pod.key.partition("/")[2], [])
            shares += [Share(name, index[uuid], units) for uuid, units in sorted(pod.held.items())]
    return held


def _gib(raw_bytes: int, where: str) -> int:
    gib, rest = divmod(raw_bytes, GIB_BYTES)
    if rest:
        raise ReplayError(f"{where}: {raw_bytes} bytes is not a whole number of GiB")
    return gib


def dra_shares(claims: Iterable[Mapping[str, Any]]) -> dict[str, list[Share]]:
    """Per pod name (the claim's, which names its pod), the memory the allocated claims of driver
    ``gpu.gpushare.io`` hold on each card, in GiB: ``status.allocation.devices.results``' pool (the node),
    device (the card) and ``consumedCapacity.memory``."""
    held: dict[str, list[Share]] = {}
    for claim in claims:
        meta = claim.get("metadata") or {}
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            continue
        ref = ClaimRef(meta.get("namespace", ""), meta.get("name", ""), meta.get("uid", ""))
        pools = {r.get("pool") for r in (allocation.get("devices") or {}).get("results") or []}
        shares = held.setdefault(ref.name, [])
        for pool in sorted(p for p in pools if isinstance(p, str)):
            try:
                allocated = claim_allocation(dict(claim), ref, pool)
            except ContractError as exc:
                raise ReplayError(str(exc)) from None
            shares += [Share(pool, s.index, _gib(s.memory_bytes, f"ResourceClaim {ref}")) for s in allocated.shares]
    return held


@dataclass(frozen=True, slots=True)
class CardLoad:
    """One card at the end of a replay, in GiB."""

    node: str
    index: int
    capacity: int
    used: int

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def holds(self, ask: GpuAsk) -> bool:
        """Whether one card's worth of ``ask`` fits here now."""
        return self.used == 0 if ask.whole else self.free >= ask.gib


@dataclass(frozen=True, slots=True)
class Outcome:
    """Where a replay left the cards, and which pods it placed and left Pending."""

    loads: tuple[CardLoad, ...]
    placed: tuple[GpuAsk, ...]
    pending: tuple[GpuAsk, ...]
    #: per card size (GiB), how many cards whole-card pods took
    whole_cards: Mapping[int, int]

    @property
    def allocated_gib(self) -> int:
        return sum(c.used for c in self.loads)

    @property
    def allocated_percent(self) -> float:
        """The memory allocated, as a share of all the cards' memory."""
        return 100 * self.allocated_gib / sum(c.capacity for c in self.loads)

    @property
    def allocated_card_percent(self) -> float:
        """The cards' allocation as the FGD paper counts it, every card 100% whatever its size."""
        return 100 * sum(c.used / c.capacity for c in self.loads) / len(self.loads)

    @property
    def empty_cards(self) -> int:
        return sum(1 for c in self.loads if c.used == 0)

    @property
    def partly_used_cards(self) -> int:
        return sum(1 for c in self.loads if 0 < c.used < c.capacity)

    @property
    def free_on_partly_used(self) -> int:
        """GiB free on cards that already hold something."""
        return sum(c.free for c in self.loads if 0 < c.used < c.capacity)

    def unusable_for(self, ask: GpuAsk) -> int:
        """GiB free on cards that can't hold one card's worth of ``ask``."""
        return sum(c.free for c in self.loads if c.free and not c.holds(ask))


def outcome(
    cards: Mapping[str, Sequence[Card]], shares: Mapping[str, Sequence[Share]], asks: Sequence[GpuAsk], bound: set[str]
) -> Outcome:
    """The cards of ``cards`` (node name -> its cards) with the ``shares`` the pods hold; ``bound``: the
    pods kube-scheduler bound. Raises ReplayError where the record and the bindings disagree: a bound pod
    holding nothing, a pod holding memory it wasn't bound for, a card that isn't there or is over-committed."""
    used: dict[tuple[str, int], int] = {}
    for pod, held in shares.items():
        if held and pod not in bound:
            raise ReplayError(f"pod {pod} holds {held[0].gib} GiB of node {held[0].node} card {held[0].index} unbound")
        for share in held:
            used[(share.node, share.index)] = used.get((share.node, share.index), 0) + share.gib
    if idle := sorted(p for p in bound if not shares.get(p)):
        raise ReplayError(f"pod {idle[0]} is bound but holds no card ({len(idle)} such pods)")
    loads = []
    for node, node_cards in sorted(cards.items()):
        for card in node_cards:
            load = CardLoad(node, card.index, GIB.units_of(card.memory_mib), used.pop((node, card.index), 0))
            if load.free < 0:
                raise ReplayError(f"node {node} card {card.index}: {load.used} GiB held of {load.capacity}")
            loads.append(load)
    if used:
        (node, index), gib = next(iter(used.items()))
        raise ReplayError(f"pods hold {gib} GiB of node {node} card {index}, which the cluster doesn't have")
    capacity = {(c.node, c.index): c.capacity for c in loads}
    whole: dict[int, int] = {}
    for ask in asks:
        if ask.whole:
            for share in shares.get(ask.pod, ()):
                size = capacity[(share.node, share.index)]
                whole[size] = whole.get(size, 0) + 1
    placed = tuple(a for a in asks if a.pod in bound)
    return Outcome(tuple(loads), placed, tuple(a for a in asks if a.pod not in bound), whole)


def median_ask(asks: Iterable[GpuAsk]) -> GpuAsk | None:
    """The middle ask by what one of its cards needs (:meth:`GpuAsk.rank`; the lower one of an even
    count), or None without asks."""
    ranked = sorted(asks, key=GpuAsk.rank)
    return ranked[(len(ranked) - 1) // 2] if ranked else None
