"""Planning a gang: a place for as many of its unbound members as fit at the same time, each member on
one node, with every member's cards and CPU/memory taken before the next is placed.

Pure: plain data in, a plan out. Members that held a place in the previous plan are placed first and
keep that place while it still fits and is among the member's nodes (so a plan two extender replicas see
stays the plan); the others go largest first, each to the node where the policy's cost of its cards is
lowest (equal costs: the node's name). It is greedy: a gang is judged by the first plan found, not by
every combination.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpushare.placement.demand import ANY_CARD, Assignment, CardCapacity, CardRule, Demand, NoFit
from gpushare.placement.fit import node_cost, place
from gpushare.placement.policies import Policy

#: how much a whole card weighs when members are ordered largest first
_WHOLE_CARD = 1 << 20


@dataclass(frozen=True, slots=True)
class Member:
    """An unbound member: its GPU demands, its (CPU milli, memory bytes) request, the nodes it may go to
    (None: any node of the plan) and what it requires of its cards (model, NVLink, NUMA)."""

    uid: str
    key: str
    demands: tuple[Demand, ...]
    host: tuple[int, int] = (0, 0)
    nodes: frozenset[str] | None = None
    rule: CardRule = ANY_CARD

    @property
    def size(self) -> int:
        return sum(d.cards * (_WHOLE_CARD if d.exclusive else d.units) for d in self.demands)

    @property
    def shape(self) -> tuple[tuple[Demand, ...], tuple[int, int], CardRule]:
        """What a node's answer for the member depends on: members of one shape get the same answer."""
        return self.demands, self.host, self.rule


@dataclass(frozen=True, slots=True)
class Room:
    """What a node has for the gang: its cards with everything but this gang's own holds counted as used,
    and its free (CPU milli, memory bytes)."""

    name: str
    cards: tuple[CardCapacity, ...]
    host: tuple[int, int]
    unit: str = "GiB"
    #: how many more pods the node takes (its allocatable pods less its pods and other gangs' holds)
    pods: int = 1 << 30


@dataclass(frozen=True, slots=True)
class Spot:
    """A member's place: the node and the units it holds per card UUID."""

    node: str
    held: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class GangPlan:
    spots: Mapping[str, Spot] = field(default_factory=dict)
    #: member keys that found no place, with the last reason one of them didn't fit
    unplaced: tuple[str, ...] = ()
    reason: str = ""


def within(cards: Sequence[CardCapacity], held: Mapping[str, int]) -> tuple[CardCapacity, ...]:
    """The cards as a member holding ``held`` may use them: on each held card no more than it holds (and
    what is really free), nothing on the others."""
    return tuple(replace(c, used=c.capacity - min(c.free, held.get(c.uuid, 0))) for c in cards)


def taking(cards: Sequence[CardCapacity], held: Mapping[str, int]) -> tuple[CardCapacity, ...]:
    """The cards once a pod holding ``held`` (units per card UUID) is on them."""
    return tuple(replace(c, used=c.used + held.get(c.uuid, 0)) for c in cards)


def held_of(assignments: Iterable[Assignment]) -> dict[str, int]:
    """Units per card UUID that assignments take."""
    held: dict[str, int] = {}
    for assignment in assignments:
        for _, uuid, units in assignment.cards:
            held[uuid] = held.get(uuid, 0) + units
    return held


class _Node:
    """A room as the plan fills it, with the policy's cost (or why not) per member shape while the node
    is unchanged: a gang's members are mostly alike, so each node is costed once per shape and again
    only after it takes a member."""

    def __init__(self, room: Room) -> None:
        self.name, self.unit = room.name, room.unit
        self.cards = list(room.cards)
        self.cpu, self.memory = room.host
        self.pods = room.pods
        self.costs: dict[tuple[tuple[Demand, ...], tuple[int, int], CardRule], float | str] = {}

    def cost(self, member: Member, policy: Policy) -> float | str:
        """The policy's cost of the member's cards here, or why they don't fit."""
        known = self.costs.get(member.shape)
        if known is None:
            try:
                known = node_cost(self.cards, member.demands, policy, unit=self.unit, rule=member.rule)
            except NoFit as nofit:
                known = nofit.reason
            self.costs[member.shape] = known
        return known

    def host_fits(self, member: Member) -> bool:
        return self.pods > 0 and member.host[0] <= self.cpu and member.host[1] <= self.memory

    def take(self, member: Member, held: Mapping[str, int]) -> None:
        self.cards = list(taking(self.cards, held))
        self.cpu, self.memory = self.cpu - member.host[0], self.memory - member.host[1]
        self.pods -= 1
        self.costs.clear()


def plan_gang(
    members: Sequence[Member], rooms: Sequence[Room], policy: Policy, previous: Mapping[str, Spot] | None = None
) -> GangPlan:
    """Places as many of ``members`` as fit on ``rooms``; see the module doc for the order."""
    previous = previous or {}
    nodes = {room.name: _Node(room) for room in rooms}
    order = sorted(members, key=lambda m: (m.uid not in previous, -m.size, m.key))
    spots: dict[str, Spot] = {}
    unplaced: list[str] = []
    reason = ""
    by_name = [nodes[name] for name in sorted(nodes)]
    for member in order:
        allowed = [n for n in by_name if member.nodes is None or n.name in member.nodes]
        spot = _keep(member, previous.get(member.uid), nodes, policy)
        if spot is None:
            spot, why = _best(member, allowed, policy)
            reason = why or reason
        if spot is None:
            unplaced.append(member.key)
            continue
        nodes[spot.node].take(member, spot.held)
        spots[member.uid] = spot
    return GangPlan(spots, tuple(unplaced), reason)


def _keep(member: Member, spot: Spot | None, nodes: Mapping[str, _Node], policy: Policy) -> Spot | None:
    """The member's previous place, when it still fits there."""
    node = nodes.get(spot.node) if spot is not None else None
    if node is None or spot is None or not node.host_fits(member):
        return None
    if member.nodes is not None and node.name not in member.nodes:
        return None
    try:
        cards = within(node.cards, spot.held)
        return Spot(node.name, held_of(place(cards, member.demands, policy, unit=node.unit, rule=member.rule)))
    except NoFit:
        return None


def _best(member: Member, allowed: Sequence[_Node], policy: Policy) -> tuple[Spot | None, str]:
    """The allowed node where the policy rates the member's cards best, or None with why not."""
    best: tuple[float, _Node] | None = None
    why = f"{member.key}: no node to try" if not allowed else ""
    for node in allowed:
        if not node.host_fits(member):
            left = "room for no more pods" if node.pods <= 0 else "not enough CPU or memory left"
            why = f"{member.key}: node {node.name} has {left}"
            continue
        cost = node.cost(member, policy)
        if isinstance(cost, str):
            why = f"{member.key}: node {node.name}: {cost}"
            continue
        if best is None or cost < best[0]:
            best = (cost, node)
    if best is None:
        return None, why
    node = best[1]
    assignments = place(node.cards, member.demands, policy, unit=node.unit, rule=member.rule)
    return Spot(node.name, held_of(assignments)), ""
