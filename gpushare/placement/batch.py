"""One pod's single demand against many nodes at once, as numpy arrays: trace replay, or a scheduler
rating a one-container pod over thousands of nodes (5,000 x 8 cards: about 2 ms for binpack, 12 ms
for fgd).

The same policy code as the per-node path in ``fit``, which asks it about one node at a time.
Cards are (nodes, cards) arrays with capacity 0 for absent cards; NVLink/NUMA tie-breaks don't exist
here (the traces carry no topology), so equally keyed cards go by position.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpushare.placement.demand import Shape
from gpushare.placement.policies import HostFit, NodeHosts, Policy, host_fit


@dataclass(frozen=True, slots=True)
class BatchChoice:
    """Per node: the policy's cost (``inf`` where the demand doesn't fit) and the card positions it
    takes (meaningless where it doesn't fit)."""

    cost: np.ndarray
    cards: np.ndarray


def able_cards(capacity: np.ndarray, free: np.ndarray, shape: Shape, allowed: np.ndarray | None = None) -> np.ndarray:
    """Per (node, card): whether one of ``shape``'s cards can go there (a whole free card when exclusive),
    among the cards ``allowed`` (per (node, card); None: every card)."""
    able = (capacity > 0) & (free >= (capacity if shape.exclusive else shape.units))
    return able if allowed is None else able & allowed


def fits(capacity: np.ndarray, free: np.ndarray, shape: Shape, allowed: np.ndarray | None = None) -> np.ndarray:
    """Per node: whether one demand of ``shape`` fits on its cards (the same test as ``check_fit``)."""
    return able_cards(capacity, free, shape, allowed).sum(axis=1) >= shape.cards


def batch_place(
    policy: Policy,
    capacity: np.ndarray,
    free: np.ndarray,
    shape: Shape,
    host: HostFit | None = None,
    allowed: np.ndarray | None = None,
) -> BatchChoice:
    """Where ``shape`` would go on each node and at what cost. ``shape.cards == 0`` asks for no GPU
    (the cost then only reflects what ``host`` says changes). ``allowed``: per (node, card), whether
    the pod's :class:`~gpushare.placement.demand.CardRule` admits the card (None: every card)."""
    nodes = free.shape[0]
    able = able_cards(capacity, free, shape, allowed)
    rows = np.flatnonzero(able.sum(axis=1) >= shape.cards)
    cost = np.full(nodes, np.inf)
    cards = np.zeros((nodes, shape.cards), dtype=np.intp)
    if not rows.size:
        return BatchChoice(cost, cards)
    if rows.size < nodes:
        capacity, free, able = capacity[rows], free[rows], able[rows]
        host = None if host is None else host.rows(rows)
    take = capacity if shape.exclusive else np.full_like(free, shape.units)
    pod = (shape,)
    if shape.cards:
        keys = np.where(able, policy.card_keys(capacity, free, take, pod, host), np.inf)
        chosen = np.argsort(keys, axis=1, kind="stable")[:, : shape.cards]
    else:
        chosen = np.zeros((len(rows), 0), dtype=np.intp)
    if shape.cards == 1 and policy.keys_are_node_costs:
        cost[rows] = np.take_along_axis(keys, chosen, axis=1)[:, 0]
    else:
        after = free.copy()
        index = np.arange(len(rows))[:, None]
        after[index, chosen] -= take[index, chosen]
        cost[rows] = policy.node_cost(capacity, free, after, pod, host)
    cards[rows] = chosen
    return BatchChoice(cost, cards)


def node_order(names: Sequence[str]) -> np.ndarray:
    """A fixed rank in [0, 1) per node name, the same in every process and run, for settling ties."""
    return np.fromiter((zlib.crc32(n.encode()) / 2**32 for n in names), dtype=np.float64, count=len(names))


def batch_costs(
    policy: Policy,
    capacity: np.ndarray,
    free: np.ndarray,
    shape: Shape,
    host: NodeHosts,
    request: tuple[int, int],
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """Per node: the policy's cost of one demand of ``shape`` (``inf`` where it doesn't fit), for a pod
    requesting ``request`` (CPU, memory); ``host`` says per node what lies beside the GPUs;
    ``allowed`` as for :func:`batch_place`. What the prioritize verb rates nodes with, and the replay too."""
    workload = getattr(policy, "workload", None)
    fit = None
    if policy.uses_host and workload is not None:
        fit = host_fit(workload, host, request, capacity)
    return batch_place(policy, capacity, free, shape, fit, allowed).cost


def batch_scores(costs: np.ndarray) -> np.ndarray:
    """0..10 scores (MaxExtenderPriority) for the prioritize verb, one per node of ``costs``: the cheapest
    node gets 10, the dearest 0, linearly in between (rounded half to even); a node costing ``inf`` (the
    pod doesn't fit there) gets 0 and doesn't count. Normalising over the candidates keeps the policy's
    ranking even when costs differ by far less than a node's size."""
    scores = np.zeros(len(costs), dtype=np.int64)
    finite = np.isfinite(costs)
    if finite.any():
        low = costs[finite].min()
        span = costs[finite].max() - low
        scores[finite] = 10 if span <= 0 else np.rint(10 * (1 - (costs[finite] - low) / span))
    return scores
