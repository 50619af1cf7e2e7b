"""Fitting a pod's demands onto one node's cards.

``place`` picks cards with a policy, ``check_fit`` only says whether (and why not) the demands fit,
and ``node_cost`` rates the node for the pod (``batch_scores`` turns those ratings into the 0..10 scores
of the prioritize verb). All are pure functions of their arguments; results depend only on the cards
and ``shape_key(demands)`` (plus the policy), never on the order either is given in.

Demands are placed most constrained first (exclusive, then multi-card, then larger), each taking the
policy's preferred option; if a later demand then doesn't fit, earlier choices are revisited (options
that leave the same free space behind are tried once), so a pod is refused only if no combination
of cards fits it.

A :class:`CardRule` narrows the cards: a card it doesn't admit (a model the pod refuses, or no memory
limits where the pod requires them) is passed over as if it were full, and with NVLink or same-NUMA
required every two distinct cards of the pod (across its containers) must be NVLink peers or share a
NUMA node; a group that breaks the rule is never offered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import combinations

import numpy as np

from gpushare.placement.demand import ANY_CARD, Assignment, CardCapacity, CardRule, Demand, NoFit, Shape, unenforced
from gpushare.placement.policies import POLICIES, Policy

#: at most this many options are tried per pod before giving up as "don't fit together"
SEARCH_BUDGET = 4096

_PACKER = POLICIES["binpack"]


def place(
    cards: Sequence[CardCapacity],
    demands: Sequence[Demand],
    policy: Policy,
    *,
    unit: str = "GiB",
    rule: CardRule = ANY_CARD,
    joined: Sequence[str] = (),
) -> tuple[Assignment, ...]:
    """Assignments for ``demands`` (in their given order) on this node; raises ``NoFit``. ``joined``:
    UUIDs of cards the pod holds already, which the rule's topology must take in too."""
    node = _Node(cards, rule)
    chosen = _solve(node, demands, policy, node.positions(joined))
    if chosen is None:
        raise _explain(node, demands, unit)
    return tuple(_assignment(node, d, chosen[d.container]) for d in demands)


def check_fit(
    cards: Sequence[CardCapacity], demands: Sequence[Demand], *, unit: str = "GiB", rule: CardRule = ANY_CARD
) -> NoFit | None:
    """``None`` if the demands fit on these cards, else why not. Same answer as ``place`` would give."""
    if len(demands) == 1 and demands[0].cards == 1:
        demand = demands[0]
        if demand.exclusive:
            if any(c.healthy and c.used == 0 and c.capacity > 0 and rule.admits(c) for c in cards):
                return None
        elif any(c.free >= demand.units and rule.admits(c) for c in cards):
            return None
        return _explain(_Node(cards, rule), demands, unit)
    node = _Node(cards, rule)
    return None if _solve(node, demands, _PACKER) is not None else _explain(node, demands, unit)


def node_cost(
    cards: Sequence[CardCapacity],
    demands: Sequence[Demand],
    policy: Policy,
    *,
    unit: str = "GiB",
    rule: CardRule = ANY_CARD,
) -> float:
    """The policy's cost of placing the pod on this node (lower is better); raises ``NoFit``."""
    node = _Node(cards, rule)
    chosen = _solve(node, demands, policy)
    if chosen is None:
        raise _explain(node, demands, unit)
    after = np.array([node.free])
    for demand in demands:
        for pos in chosen[demand.container]:
            after[0, pos] -= _take(node, demand, pos)
    return float(policy.node_cost(node.row, np.array([node.free]), after, _pod(demands))[0])


class _Node:
    """A node's cards sorted by index, with their free units (0 on unhealthy cards), which of them the
    pod's rule lets it have, and ``row``: the capacities as the one-row array the policies take."""

    __slots__ = ("allowed", "capacity", "cards", "free", "row", "rule")

    def __init__(self, cards: Sequence[CardCapacity], rule: CardRule = ANY_CARD) -> None:
        self.cards = sorted(cards, key=lambda c: c.index)
        self.capacity = [c.capacity if c.healthy else 0 for c in self.cards]
        self.free = [c.free for c in self.cards]
        self.rule = rule
        self.allowed = [rule.admits(c) for c in self.cards]
        self.row = np.array([self.capacity], dtype=np.int64).reshape(1, len(self.cards))

    def can_take(self, demand: Demand, pos: int, free: Sequence[int]) -> bool:
        cap = self.capacity[pos]
        if not self.allowed[pos]:
            return False
        if demand.exclusive:
            return cap > 0 and free[pos] == cap
        return free[pos] >= demand.units

    def joins(self, pos: int, members: Sequence[int]) -> bool:
        """Whether the card at ``pos`` may join the pod's cards at ``members`` under the rule."""
        return not self.rule.topology or all(self.rule.joinable(self.cards[pos], self.cards[m]) for m in members)

    def positions(self, uuids: Sequence[str]) -> list[int]:
        wanted = set(uuids)
        return [p for p, c in enumerate(self.cards) if c.uuid in wanted]

    def ignored(self) -> str:
        """``; Tesla T4 cards ignored; card 2 (GPU-c) doesn't enforce GPU memory limits: <why>``: the
        cards the rule refuses, by model or by cause, for messages."""
        refused = [c for c, ok in zip(self.cards, self.allowed, strict=True) if not ok]
        models = sorted({c.model or "unknown" for c in refused if not self.rule.accepts(c.model)})
        unlimited = [c for c in refused if self.rule.accepts(c.model)]
        parts = [f"{', '.join(models)} cards ignored"] if models else []
        parts += [unenforced(unlimited)] if unlimited else []
        return "".join(f"; {part}" for part in parts)


def _take(node: _Node, demand: Demand, pos: int) -> int:
    return node.capacity[pos] if demand.exclusive else demand.units


def _pod(demands: Sequence[Demand]) -> tuple[Shape, ...]:
    return tuple(sorted(d.shape for d in demands))


def _order(demands: Sequence[Demand]) -> list[Demand]:
    names = [d.container for d in demands]
    if len(set(names)) != len(names):
        raise ValueError(f"containers named more than once among {sorted(names)}")
    return sorted(demands, key=lambda d: (not d.exclusive, -d.cards, -d.units, d.container))


def _solve(
    node: _Node, demands: Sequence[Demand], policy: Policy, held: Sequence[int] = ()
) -> dict[str, tuple[int, ...]] | None:
    """Card positions per container, or None if no combination fits. ``held``: positions of cards the
    pod holds already (they count for the rule's topology only)."""
    pod = _pod(demands)
    members = list(held)
    if len(demands) == 1:
        first = next(_options(node, demands[0], node.free, policy, pod, members), None)
        return None if first is None else {demands[0].container: first}
    ordered = _order(demands)
    free = list(node.free)
    budget = [SEARCH_BUDGET]
    chosen: dict[str, tuple[int, ...]] = {}

    def search(i: int) -> bool:
        if i == len(ordered):
            return True
        demand = ordered[i]
        tried: set[tuple[tuple[int, int], ...]] = set()
        for option in _options(node, demand, free, policy, pod, members):
            # with a topology rule, which cards they are matters, not only what they leave free
            signature = tuple(sorted((free[p], node.capacity[p] if not node.rule.topology else p) for p in option))
            if signature in tried:
                continue
            tried.add(signature)
            budget[0] -= 1
            if budget[0] < 0:
                return False
            added = [p for p in option if p not in members]
            members.extend(added)
            for p in option:
                free[p] -= _take(node, demand, p)
            if search(i + 1):
                chosen[demand.container] = option
                return True
            for p in option:
                free[p] += _take(node, demand, p)
            del members[len(members) - len(added) :]
        return False

    return chosen if search(0) else None


def _options(
    node: _Node, demand: Demand, free: list[int], policy: Policy, pod: tuple[Shape, ...], members: Sequence[int]
) -> Iterator[tuple[int, ...]]:
    """Card groups for one demand that the rule allows beside ``members``, the policy's preferred first."""
    candidates = [p for p in range(len(free)) if node.can_take(demand, p, free) and node.joins(p, members)]
    if len(candidates) < demand.cards:
        return
    take = np.array([[_take(node, demand, p) for p in range(len(free))]], dtype=np.int64)
    keys = policy.card_keys(node.row, np.array([free], dtype=np.int64), take, pod)[0].tolist()
    key_of = {p: keys[p] for p in candidates}
    ranked = sorted(candidates, key=lambda p: (key_of[p], p))
    if demand.cards == 1:
        for p in ranked:
            yield (p,)
        return
    best = _preferred_group(node, ranked, key_of, demand.cards)
    if best is not None:
        yield best
    budget = SEARCH_BUDGET
    for group in combinations(ranked, demand.cards):
        ordered_group = tuple(sorted(group))
        if ordered_group == best:
            continue
        if node.rule.topology:
            budget -= 1
            if budget < 0:
                return
            if not all(node.joins(p, ordered_group) for p in ordered_group):
                continue
        yield ordered_group


def _preferred_group(node: _Node, ranked: list[int], key_of: dict[int, float], size: int) -> tuple[int, ...] | None:
    """The group for a multi-card demand: most NVLink pairs first, then most pairs sharing a NUMA node;
    among equally connected groups the policy's preference (lowest summed key) decides. None when no
    group grown this way meets the rule's topology."""
    best: tuple[tuple[int, int, float, list[int]], list[int]] | None = None
    for start in ranked:
        members = _grow(node, [start], ranked, key_of, size)
        if members is None:
            continue
        links, numa, order = _group_rating(node, members)
        rating = (links, numa, -sum(key_of[m] for m in members), order)
        if best is None or rating > best[0]:
            best = (rating, members)
    return None if best is None else tuple(sorted(best[1]))


def _grow(node: _Node, start: list[int], pool: list[int], key_of: dict[int, float], size: int) -> list[int] | None:
    """``start`` plus the cards of ``pool`` with the most affinity to those already chosen (None when
    the rule's topology runs out of cards that may join them)."""
    members = list(start)
    rest = [p for p in pool if p not in members]
    while len(members) < size:
        joining = [p for p in rest if node.joins(p, members)]
        if not joining:
            return None
        pick = max(joining, key=lambda p: (*_affinity(node, p, members), -key_of[p], -p))
        members.append(pick)
        rest.remove(pick)
    return members


def _linked(a: CardCapacity, b: CardCapacity) -> bool:
    return b.uuid in a.nvlink or a.uuid in b.nvlink


def _affinity(node: _Node, pos: int, members: list[int]) -> tuple[int, int]:
    card = node.cards[pos]
    links = sum(_linked(card, node.cards[m]) for m in members)
    numa = sum(card.numa is not None and card.numa == node.cards[m].numa for m in members)
    return links, numa


def _group_rating(node: _Node, members: list[int]) -> tuple[int, int, list[int]]:
    links = numa = 0
    for i, a in enumerate(members):
        link, same = _affinity(node, a, members[i + 1 :])
        links += link
        numa += same
    return links, numa, [-p for p in sorted(members)]


def _assignment(node: _Node, demand: Demand, positions: tuple[int, ...]) -> Assignment:
    return Assignment(
        demand.container,
        tuple((node.cards[p].index, node.cards[p].uuid, _take(node, demand, p)) for p in positions),
    )


def _explain(node: _Node, demands: Sequence[Demand], unit: str) -> NoFit:
    if not node.cards:
        return NoFit("node has no GPUs")
    if not any(node.capacity):
        return NoFit(f"no healthy card ({len(node.cards)} unhealthy)")
    if not any(c and ok for c, ok in zip(node.capacity, node.allowed, strict=True)):
        kind = "healthy " if any(node.allowed) else ""
        return NoFit(f"no {kind}{node.rule.label()} card on the node ({node.ignored()[2:]})")
    for demand in _order(demands):
        reason = _alone(node, demand, unit)
        if reason is not None:
            prefix = f"container {demand.container}: " if len(demands) > 1 else ""
            return NoFit(prefix + reason)
    free = ", ".join(
        f"{u} on card {c.index}" for c, u, ok in zip(node.cards, node.free, node.allowed, strict=True) if ok
    )
    if node.rule.topology and _solve(_Node(node.cards, node.rule.without_topology()), demands, _PACKER) is not None:
        what = _wanted(demands[0], node.rule.label(), unit) if len(demands) == 1 else "the pod's containers"
        return NoFit(
            f"no cards {node.rule.requirement()} (required) can take {what} (free {unit}: {free}{node.ignored()})"
        )
    names = ", ".join(sorted(d.container for d in demands))
    return NoFit(f"containers {names} each fit alone but not together (free {unit}: {free}{node.ignored()})")


def _wanted(demand: Demand, label: str, unit: str) -> str:
    """``2 whole free A100 cards``, ``2 cards with 8 GiB free each``: what one demand asks for."""
    kind = f"{label} card" if label else "card"
    if demand.exclusive:
        return f"a whole free {kind}" if demand.cards == 1 else f"{demand.cards} whole free {kind}s"
    return f"{demand.cards} {kind}s with {demand.units} {unit} free each"


def _alone(node: _Node, demand: Demand, unit: str) -> str | None:
    """Why ``demand`` can't be placed even on its own, or None if it can."""
    able = sum(node.can_take(demand, p, node.free) for p in range(len(node.cards)))
    if able >= demand.cards:
        return None
    label = node.rule.label()
    ignored = node.ignored()
    if demand.exclusive:
        return f"needs {_wanted(demand, label, unit)}, {able} completely free ({len(node.cards)} cards{ignored})"
    allowed = [p for p in range(len(node.cards)) if node.allowed[p]]
    largest = max(allowed, key=lambda p: (node.free[p], -p))
    most = f"largest free: {node.free[largest]} {unit} on card {node.cards[largest].index}{ignored}"
    if demand.cards == 1:
        kind = f"{label} card" if label else "single card"
        return f"no {kind} has {demand.units} {unit} free ({most})"
    return f"needs {_wanted(demand, label, unit)}, {able} have ({most})"
