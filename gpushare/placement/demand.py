"""Plain data for placement: what a pod demands of a node's cards (each container's shape, and the pod's
card rule), the cards as the scheduler sees them, and the assignment that results."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from gpushare.cards import ENFORCED, NOT_REPORTED, Card


@dataclass(frozen=True, slots=True)
class CardCapacity:
    """What placement sees of one card: its capacity and the units already used of it, in the plugin's
    memory unit (the inventory's description of a card is :class:`gpushare.cards.Card`)."""

    index: int
    uuid: str
    capacity: int
    used: int
    healthy: bool = True
    numa: int | None = None
    nvlink: frozenset[str] = frozenset()
    model: str = ""
    #: :data:`~gpushare.cards.ENFORCED` when the driver caps each container at its share, else why not
    memory_limits: str = NOT_REPORTED

    @classmethod
    def of(cls, card: Card, capacity: int = 0, used: int = 0, *, healthy: bool = True) -> CardCapacity:
        """``card`` as placement sees it, holding ``used`` of ``capacity`` units."""
        return cls(
            card.index,
            card.uuid,
            capacity,
            used,
            healthy=healthy,
            numa=card.numa_node,
            nvlink=frozenset(card.nvlink_peers),
            model=card.model,
            memory_limits=card.memory_limits,
        )

    @property
    def limits_enforced(self) -> bool:
        return self.memory_limits == ENFORCED

    @property
    def free(self) -> int:
        """Units that can still be handed out; an unhealthy card has none."""
        return max(self.capacity - self.used, 0) if self.healthy else 0


@dataclass(frozen=True, slots=True)
class Demand:
    """One container's GPU demand.

    Shared: ``units`` on each of ``cards`` distinct cards. Exclusive: ``cards`` whole, completely free
    cards (``units`` is 0 and each card then counts as fully used).
    """

    container: str
    units: int
    cards: int = 1
    exclusive: bool = False

    def __post_init__(self) -> None:
        if self.cards < 1:
            raise ValueError(f"container {self.container}: cards must be >= 1, got {self.cards}")
        if self.exclusive and self.units:
            raise ValueError(f"container {self.container}: an exclusive demand takes whole cards, units must be 0")
        if not self.exclusive and self.units < 1:
            raise ValueError(f"container {self.container}: a shared demand needs units >= 1, got {self.units}")

    @property
    def shape(self) -> Shape:
        return Shape(self.units, self.cards, self.exclusive)


@dataclass(frozen=True, slots=True, order=True)
class Shape:
    """A demand without its container name: what fragmentation and caches are keyed on."""

    units: int
    cards: int = 1
    exclusive: bool = False

    def threshold(self, capacity: int) -> int:
        """Free units a card of ``capacity`` needs to take one of this shape's cards."""
        return capacity if self.exclusive else self.units


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where one container goes: ``(card index, card uuid, units taken)`` per card.

    An exclusive card records its whole capacity as taken.
    """

    container: str
    cards: tuple[tuple[int, str, int], ...]


class NoFit(Exception):
    """The demands can't be placed on this node; ``reason`` is the human explanation."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def shape_key(demands: tuple[Demand, ...] | list[Demand]) -> tuple[Shape, ...]:
    """Container-name-free key of a pod's demands (sorted), for memoising per-node results."""
    return tuple(sorted(d.shape for d in demands))


@lru_cache(maxsize=4096)
def model_words(name: str) -> frozenset[str]:
    """The words of a card model name: split at spaces and dashes, compared ignoring case."""
    return frozenset(w for w in re.split(r"[\s-]+", name.casefold()) if w)


def model_matches(pattern: str, model: str) -> bool:
    """Whether ``pattern`` names cards of ``model``: every word of the pattern is a word of the model.

    So ``A100-80GB`` matches ``NVIDIA A100-SXM4-80GB`` and ``NVIDIA A100 80GB PCIe``, ``T4`` matches
    ``Tesla T4``, ``A100`` every A100, and a model's full name matches itself; ``A10`` is not ``A100``.
    """
    words = model_words(pattern)
    return bool(words) and words <= model_words(model)


@dataclass(frozen=True, slots=True)
class CardRule:
    """What a pod requires of its cards beyond free memory.

    ``models``: patterns of acceptable card models (empty: any model); ``avoid``: patterns of models
    it must not get (see :func:`model_matches`). ``nvlink``/``same_numa``: every two distinct cards
    the pod gets must be NVLink peers / on one (known) NUMA node. ``memory_limits``: every card the
    pod gets must have the driver enforce its GPU memory share.
    """

    models: frozenset[str] = frozenset()
    avoid: frozenset[str] = frozenset()
    nvlink: bool = False
    same_numa: bool = False
    memory_limits: bool = False

    def accepts(self, model: str) -> bool:
        """Whether a card of ``model`` may be given to the pod."""
        return _accepts(self.models, self.avoid, model)

    def admits(self, card: CardCapacity) -> bool:
        """Whether ``card`` may be given to the pod: the one decision of a card's eligibility (its
        model, and its memory limits where the pod requires them); :meth:`refusal` says why not."""
        return self.accepts(card.model) and (card.limits_enforced or not self.memory_limits)

    def refusal(self, card: CardCapacity) -> str | None:
        """Why ``card`` may not be given to the pod, or None when :meth:`admits` lets it."""
        if self.admits(card):
            return None
        if not self.accepts(card.model):
            model = card.model or "unknown-model"
            return f"card {card.index} ({card.uuid}) is a {model} card; the pod takes only {self.label()} cards"
        return unenforced([card])

    def card_mask(
        self, card_models: np.ndarray, models: Sequence[str], enforced: np.ndarray | None = None
    ) -> np.ndarray:
        """Per card of ``card_models`` (any array of numbers into ``models``): whether :meth:`admits`
        lets the pod have it; ``enforced`` (the same shape) says which cards enforce memory limits, and
        is required when the rule requires them."""
        accepted = np.fromiter((self.accepts(m) for m in models), dtype=bool, count=len(models))
        mask = accepted[card_models]
        if not self.memory_limits:
            return mask
        if enforced is None:
            raise ValueError("a rule requiring memory limits needs to know which cards enforce them")
        return mask & enforced

    @property
    def picks_models(self) -> bool:
        return bool(self.models or self.avoid)

    @property
    def picks_cards(self) -> bool:
        """Whether the rule passes over some cards (by model or memory limits), not only some groups."""
        return self.picks_models or self.memory_limits

    @property
    def topology(self) -> bool:
        return self.nvlink or self.same_numa

    def without_topology(self) -> CardRule:
        return CardRule(self.models, self.avoid, memory_limits=self.memory_limits)

    def models_only(self) -> CardRule:
        return CardRule(self.models, self.avoid)

    def joinable(self, a: CardCapacity, b: CardCapacity) -> bool:
        """Whether one pod may hold both cards under this rule."""
        if a.uuid == b.uuid:
            return True
        if self.nvlink and b.uuid not in a.nvlink and a.uuid not in b.nvlink:
            return False
        return not self.same_numa or (a.numa is not None and a.numa == b.numa)

    def label(self) -> str:
        """How messages name the acceptable cards: ``A100-80GB or A100-40GB``, ``non-T4``,
        ``limit-enforcing``; empty for any."""
        words = [" or ".join(sorted(self.models))] if self.models else []
        words += [f"non-{m}" for m in sorted(self.avoid)]
        words += ["limit-enforcing"] if self.memory_limits else []
        return " ".join(words)

    def violation(self, cards: Sequence[CardCapacity]) -> str | None:
        """Why one pod holding ``cards`` breaks this rule, or None when it doesn't."""
        for card in cards:
            if (refusal := self.refusal(card)) is not None:
                return refusal
        for i, a in enumerate(cards):
            for b in cards[i + 1 :]:
                if not self.joinable(a, b):
                    return f"cards {a.index} and {b.index} are not {self.requirement()}, as the pod requires"
        return None

    def requirement(self) -> str:
        """How messages name the topology requirement: ``pairwise NVLink-connected, on one NUMA node``."""
        parts = ["pairwise NVLink-connected"] if self.nvlink else []
        return ", ".join([*parts, "on one NUMA node"] if self.same_numa else parts)


def unenforced(cards: Sequence[CardCapacity]) -> str:
    """``card 0 (GPU-a) doesn't enforce GPU memory limits: <why>``: how messages name cards without
    memory limits, one clause per cause (``cards 0 (GPU-a), 1 (GPU-b) don't ...``)."""
    causes: dict[str, list[CardCapacity]] = {}
    for card in cards:
        causes.setdefault(card.memory_limits, []).append(card)
    clauses = []
    for cause, group in causes.items():
        named = ", ".join(f"{c.index} ({c.uuid})" for c in group)
        verb = "doesn't" if len(group) == 1 else "don't"
        clauses.append(f"card{'s' if len(group) > 1 else ''} {named} {verb} enforce GPU memory limits: {cause}")
    return "; ".join(clauses)


#: the rule of a pod that asks nothing of its cards' model, topology or memory limits
ANY_CARD = CardRule()


@lru_cache(maxsize=4096)
def _accepts(models: frozenset[str], avoid: frozenset[str], model: str) -> bool:
    if models and not any(model_matches(p, model) for p in models):
        return False
    return not any(model_matches(p, model) for p in avoid)
