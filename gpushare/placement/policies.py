"""Placement policies: which card(s) of a node a demand takes, and how good a node is for a pod.

Every policy answers two questions, each in one vectorised implementation over (nodes, cards) arrays
(absent cards have capacity 0). The extender's per-node path asks about one node (a one-row array),
prioritize and the trace replay about thousands at once:

- *card keys*: for each card, a number for taking ``take`` units from it; lower is preferred (cards
  that can't take the demand are masked by the caller);
- *node cost*: given each node's free units before and after placing the whole pod, a number;
  lower is preferred.

All costs are pure functions of (cards, pod shapes[, workload, host fit]), so callers may memoise them
per (node generation, ``shape_key(demands)``, policy name[, workload version]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from gpushare.placement.demand import CardRule, Shape
from gpushare.placement.fragmentation import Workload, fragmentation, placement_deltas

Pod = tuple[Shape, ...]


class Policy(Protocol):
    name: str
    #: True when a card's key is exactly the node cost of a pod that takes only that card
    keys_are_node_costs: bool
    #: True when the policy weighs the nodes' CPU and memory (``HostFit``) too
    uses_host: bool

    def card_keys(
        self, capacity: np.ndarray, free: np.ndarray, take: np.ndarray, pod: Pod, host: HostFit | None = None
    ) -> np.ndarray:
        """A key per card of each node, taking ``take`` units from it: (nodes, cards) arrays in and out."""
        ...

    def node_cost(
        self, capacity: np.ndarray, before: np.ndarray, after: np.ndarray, pod: Pod, host: HostFit | None = None
    ) -> np.ndarray:
        """How bad it is to turn each node's free units ``before`` into ``after``: (nodes, cards) arrays
        in, (nodes,) out."""
        ...


@dataclass(frozen=True, slots=True)
class NodeHosts:
    """Per node, what a host-aware policy weighs besides the GPUs' free units: free CPU and memory, a
    fixed rank in [0, 1) that settles otherwise equal costs (``node_order``), and optionally each card's
    model, as a number into ``models``."""

    cpu: np.ndarray
    memory: np.ndarray
    order: np.ndarray
    card_models: np.ndarray | None = None
    models: tuple[str, ...] = ()

    def rows(self, rows: np.ndarray) -> NodeHosts:
        card_models = None if self.card_models is None else self.card_models[rows]
        return NodeHosts(self.cpu[rows], self.memory[rows], self.order[rows], card_models, self.models)


@dataclass(frozen=True, slots=True)
class HostFit:
    """What a caller knows beyond GPUs (CPU, memory, model): per (node, workload shape), could the node
    host the shape apart from its GPUs, before and after the placement; and optionally the ``nodes``
    themselves (free CPU and memory before the placement, fixed rank) with the pod's (CPU, memory)
    ``request``. Only the fragmentation-aware policies use it."""

    before: np.ndarray
    after: np.ndarray
    nodes: NodeHosts | None = None
    request: tuple[int, int] = (0, 0)

    def rows(self, rows: np.ndarray) -> HostFit:
        nodes = None if self.nodes is None else self.nodes.rows(rows)
        return HostFit(self.before[rows], self.after[rows], nodes, self.request)


def host_fit(workload: Workload, nodes: NodeHosts, request: tuple[int, int], capacity: np.ndarray) -> HostFit:
    """Whether each node could host each of the workload's shapes apart from its GPUs (free CPU and
    memory, and a card of a model the shape accepts), before and after a pod requesting ``request``
    (CPU, memory) lands there; ``capacity`` is the nodes' (nodes, cards) GPU capacity."""
    need = np.array(workload.hosts, dtype=np.int64).reshape(len(workload), 2)
    cpu, memory = nodes.cpu, nodes.memory
    access = None if nodes.card_models is None else workload.access(nodes.card_models, nodes.models, capacity)

    def fit(c: np.ndarray, m: np.ndarray) -> np.ndarray:
        ok = (c[:, None] >= need[:, 0]) & (m[:, None] >= need[:, 1])
        return ok if access is None else ok & access

    return HostFit(fit(cpu, memory), fit(cpu - request[0], memory - request[1]), nodes, request)


class _FreeSpace:
    """Cards and nodes ranked by free space alone: the least first with ``sign`` 1, the most with -1."""

    sign = 1.0
    keys_are_node_costs = False
    uses_host = False

    def card_keys(
        self, capacity: np.ndarray, free: np.ndarray, take: np.ndarray, pod: Pod, host: HostFit | None = None
    ) -> np.ndarray:
        return self.sign * free.astype(np.float64)

    def node_cost(
        self, capacity: np.ndarray, before: np.ndarray, after: np.ndarray, pod: Pod, host: HostFit | None = None
    ) -> np.ndarray:
        return self.sign * after.sum(axis=1).astype(np.float64)


class Binpack(_FreeSpace):
    """The original gpushare's choice: the card with the least free space that fits; fuller nodes first."""

    name = "binpack"


class Spread(_FreeSpace):
    """The card with the most free space; emptier nodes first."""

    name = "spread"
    sign = -1.0


class Fgd:
    """Fragmentation gradient descent: the placement that increases the node's fragmentation least.

    With an empty workload (nothing observed yet) the pod being placed stands in for the typical
    workload: placements that keep room for another pod like it are preferred.
    """

    name = "fgd"
    keys_are_node_costs = True
    uses_host = False

    def __init__(self, workload: Workload | None = None) -> None:
        self.workload = workload if workload is not None and len(workload) else None

    def _workload(self, pod: Pod, host: HostFit | None) -> Workload:
        if self.workload is not None:
            return self.workload
        if host is not None:
            raise ValueError("fgd: host fit describes a workload's shapes, but this policy has no workload")
        return Workload.from_shapes(pod, coverage=1.0)

    def card_keys(
        self, capacity: np.ndarray, free: np.ndarray, take: np.ndarray, pod: Pod, host: HostFit | None = None
    ) -> np.ndarray:
        workload = self._workload(pod, host)
        if host is None:
            return placement_deltas(free, capacity, workload, take)
        return placement_deltas(free, capacity, workload, take, host.before, host.after)

    def node_cost(
        self, capacity: np.ndarray, before: np.ndarray, after: np.ndarray, pod: Pod, host: HostFit | None = None
    ) -> np.ndarray:
        workload = self._workload(pod, host)
        return fragmentation(after, capacity, workload, None if host is None else host.after) - (
            fragmentation(before, capacity, workload, None if host is None else host.before)
        )


class FgdFit(Fgd):
    """Fragmentation gradient descent that also counts CPU and memory, and settles near-equal placements
    by a fixed node order.

    Cost of a placement, lowest first: the GPU it strands, in steps of ``1/QUANTA`` of a card; then the
    node's fixed rank, so that equal placements keep going to the same nodes. Stranded GPU is the
    fragmentation added (GPU the typical pods, weighted by how often each arrives, could no longer use,
    including a node's idle GPU for shapes whose CPU, memory or card model doesn't suit it) plus the
    idle GPU that the placement leaves without enough free CPU and memory to feed it at the rate the
    typical GPU pods consume them (``Workload.stranded``), so a CPU-hungry pod steers away from nodes
    short of CPU for their GPUs. A pod without GPUs also pays ``IDLE_WEIGHT`` cards for a node whose
    GPUs are all idle (in proportion for fewer), so that it goes where the GPUs are taken.
    """

    name = "fgdfit"
    keys_are_node_costs = True
    uses_host = True
    QUANTA = 25
    IDLE_WEIGHT = 8.0

    @classmethod
    def of(cls, observed: Sequence[tuple[Shape, int, int, CardRule]]) -> FgdFit:
        """The policy for pods ``observed`` as (GPU shape, CPU, memory, card rule). Pods without GPUs count
        towards which shapes are typical, but weigh nothing: no placement of a GPU changes what they can
        use."""
        workload = Workload.from_pods(observed)
        counts = tuple(n if s.cards else 0 for s, n in zip(workload.shapes, workload.counts, strict=True))
        return cls(replace(workload, counts=counts) if any(counts) else None)

    def card_keys(
        self, capacity: np.ndarray, free: np.ndarray, take: np.ndarray, pod: Pod, host: HostFit | None = None
    ) -> np.ndarray:
        idle = free.sum(axis=1)
        delta = super().card_keys(capacity, free, take, pod, host)
        delta = delta + self._starved(capacity, idle[:, None], idle[:, None] - take, host)
        return self._settle(capacity, delta, idle[:, None] - take, pod, host)

    def node_cost(
        self, capacity: np.ndarray, before: np.ndarray, after: np.ndarray, pod: Pod, host: HostFit | None = None
    ) -> np.ndarray:
        idle, rest = before.sum(axis=1), after.sum(axis=1)
        delta = super().node_cost(capacity, before, after, pod, host) + self._starved(capacity, idle, rest, host)
        return self._settle(capacity, delta, rest, pod, host)

    def _starved(self, capacity: np.ndarray, idle: np.ndarray, rest: np.ndarray, host: HostFit | None) -> np.ndarray:
        """How much more idle GPU the node's free CPU and memory can't feed once the pod (taking the GPU
        from ``idle`` down to ``rest``, and the host's request) is placed; never less than 0: taking GPU
        that was stranded already earns nothing, or GPU-hungry pods would crowd into small CPU-poor pools
        of a model that other pods can use only there."""
        if host is None or host.nodes is None or self.workload is None:
            return np.zeros(rest.shape)
        card, nodes = _card_units(capacity), host.nodes
        cpu, memory = nodes.cpu - host.request[0], nodes.memory - host.request[1]
        newly = self.workload.stranded(rest, card, cpu, memory) - self.workload.stranded(
            idle, card, nodes.cpu, nodes.memory
        )
        return np.maximum(newly, 0)

    def _settle(
        self, capacity: np.ndarray, delta: np.ndarray, idle: np.ndarray, pod: Pod, host: HostFit | None
    ) -> np.ndarray:
        """Quantised fragmentation (plus the idle charge of a pod without GPUs), then the fixed rank."""
        total, card = np.maximum(capacity.sum(axis=1), 1), _card_units(capacity)
        if delta.ndim == 2:
            total, card = total[:, None], card[:, None]
        cost = np.floor(delta * self.QUANTA / card + 1e-9)
        if not any(shape.cards for shape in pod):
            cost = cost + self.IDLE_WEIGHT * self.QUANTA * idle / total
        if host is not None and host.nodes is not None:
            order = host.nodes.order
            cost = cost + 1e-3 * (order if delta.ndim == 1 else order[:, None])
        return cost


def _card_units(capacity: np.ndarray) -> np.ndarray:
    """Per node: the units of one of its cards (their mean; at least 1)."""
    return np.maximum(capacity.sum(axis=1), 1) / np.maximum((capacity > 0).sum(axis=1), 1)


POLICIES: dict[str, Policy] = {p.name: p for p in (Binpack(), Spread(), Fgd(), FgdFit())}
DEFAULT_POLICY = "fgdfit"
