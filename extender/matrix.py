"""The cache's nodes as numpy rows, so filter and prioritize over thousands of nodes are array maths.

Each known node owns one row: its cards' capacity and free units (0 for unhealthy or absent cards,
and for every card of a node the extender can't place on), their models (as numbers into a list of
the models seen, so a pod's :class:`~gpushare.placement.CardRule` becomes a per-card mask by one
lookup) and whether each enforces memory limits, its free CPU and memory, a fixed rank for ties, and
the generation they were read at.
Rows are refreshed lazily: the cache reports which nodes changed, and the next query re-reads only
those. A query works on every row at once, then picks the rows of the nodes it was asked about; the
row numbers of the last few lists of names asked about are kept, since kube-scheduler asks about the
same lists again and again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from itertools import repeat

import numpy as np
from gpushare.extender.cache import ClusterCache
from gpushare.extender.wire import NodeNames

from gpushare import placement
from gpushare.placement.memo import UNKNOWN, CostMemo

_INITIAL_WIDTH = 8
#: lists of node names whose row numbers are kept
LOOKUPS_KEPT = 8
#: the generation of a row whose node the extender can't place on
_UNUSABLE = UNKNOWN


class NodeMatrix:
    def __init__(self, cache: ClusterCache) -> None:
        self._cache = cache
        self._lock = threading.Lock()
        self._row: dict[str, int] = {}
        self._capacity = np.zeros((0, _INITIAL_WIDTH), dtype=np.int64)
        self._free = np.zeros((0, _INITIAL_WIDTH), dtype=np.int64)
        self._model = np.zeros((0, _INITIAL_WIDTH), dtype=np.intp)
        self._enforced = np.zeros((0, _INITIAL_WIDTH), dtype=bool)
        #: the card models seen, numbered by first sight ("" for absent cards)
        self._models: dict[str, int] = {"": 0}
        self._cpu = np.zeros(0, dtype=np.int64)
        self._memory = np.zeros(0, dtype=np.int64)
        self._order = np.zeros(0)
        self._generation = np.zeros(0, dtype=np.int64)
        self._dirty: set[str] = set()
        self._dirty_lock = threading.Lock()
        self._lookups: OrderedDict[str, np.ndarray] = OrderedDict()
        cache.add_change_listener(self._changed)

    def _changed(self, node: str) -> None:
        # Called under the cache's lock: only the dirty set's own lock may be taken here.
        with self._dirty_lock:
            self._dirty.add(node)

    def refresh(self) -> None:
        """Bring the rows of every node that changed up to date (queries do this themselves)."""
        with self._lock:
            self._refresh()

    def fits(
        self, names: NodeNames, shape: placement.Shape, rule: placement.CardRule = placement.ANY_CARD
    ) -> np.ndarray:
        """Per name: whether one demand of ``shape`` fits on the node's cards that ``rule`` admits (False
        for a node the extender doesn't know or can't place on)."""
        with self._lock:
            self._refresh()
            rows = len(self._row)
            fit = placement.fits(self._capacity[:rows], self._free[:rows], shape, self._allowed(rule, rows))
            return _pick(fit, self._lookup(names), False)

    def _allowed(self, rule: placement.CardRule, rows: int) -> np.ndarray | None:
        """Per (row, card): whether ``rule`` admits the card; None when it admits every card. Under the
        lock."""
        if not rule.picks_cards:
            return None
        return rule.card_mask(self._model[:rows], tuple(self._models), self._enforced[:rows])

    def costs(
        self,
        names: NodeNames,
        memo: CostMemo,
        policy: placement.Policy,
        shape: placement.Shape,
        request: tuple[int, int] = (0, 0),
        rule: placement.CardRule = placement.ANY_CARD,
    ) -> np.ndarray:
        """Per name: the policy's cost of one demand of ``shape`` on the node's cards that ``rule``
        admits, for a pod requesting ``request`` (CPU milli, memory bytes), kept in ``memo`` (``inf``
        where it doesn't fit, or the node is unknown or unusable). A memo serves one rule."""
        with self._lock:
            self._refresh()
            rows = len(self._row)
            host = self._hosts(rows)
            cost = memo.costs(
                self._capacity[:rows],
                self._free[:rows],
                self._generation[:rows],
                host,
                policy,
                shape,
                request,
                self._allowed(rule, rows),
            )
            return _pick(cost, self._lookup(names), np.inf)

    def memo(
        self,
        policy: placement.Policy,
        shape: placement.Shape,
        request: tuple[int, int] = (0, 0),
        rule: placement.CardRule = placement.ANY_CARD,
    ) -> CostMemo:
        """A memo of ``policy``'s costs of ``shape`` on every node, computed on a copy of the rows so that
        queries go on meanwhile; rows that change in between are computed again when next asked."""
        with self._lock:
            self._refresh()
            rows = len(self._row)
            capacity, free = self._capacity[:rows].copy(), self._free[:rows].copy()
            host = self._hosts(rows).rows(np.arange(rows))
            generation = self._generation[:rows].copy()
            allowed = self._allowed(rule, rows)
        memo = CostMemo()
        memo.costs(capacity, free, generation, host, policy, shape, request, allowed)
        return memo

    def _hosts(self, rows: int) -> placement.NodeHosts:
        """What lies beside the GPUs of the first ``rows`` rows (views of the rows); under the lock."""
        return placement.NodeHosts(
            self._cpu[:rows], self._memory[:rows], self._order[:rows], self._model[:rows], tuple(self._models)
        )

    def _lookup(self, names: NodeNames) -> np.ndarray:
        """Row numbers of ``names`` (-1 for unknown names)."""
        key = names.text
        index = None if key is None else self._lookups.get(key)
        if index is not None:
            self._lookups.move_to_end(key)
            return index
        index = np.fromiter(map(self._row.get, names.names, repeat(-1)), dtype=np.intp, count=len(names))
        if key is not None:
            self._lookups[key] = index
            if len(self._lookups) > LOOKUPS_KEPT:
                self._lookups.popitem(last=False)
        return index

    def _refresh(self) -> None:
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        for name in dirty:
            row = self._row.get(name)
            if row is None:
                row = self._add_row(name)
            view = self._cache.view(name)
            self._capacity[row] = 0
            self._free[row] = 0
            self._model[row] = 0
            self._enforced[row] = False
            if view is None:
                self._cpu[row] = self._memory[row] = 0
                self._generation[row] = _UNUSABLE
                continue
            self._cpu[row], self._memory[row] = view.host_free
            if len(view.cards) > self._capacity.shape[1]:
                self._widen(len(view.cards))
            for pos, card in enumerate(view.cards):
                self._capacity[row, pos] = card.capacity if card.healthy else 0
                self._free[row, pos] = card.free
                self._model[row, pos] = self._models.setdefault(card.model, len(self._models))
                self._enforced[row, pos] = card.limits_enforced
            self._generation[row] = view.generation

    def _add_row(self, name: str) -> int:
        row = len(self._row)
        if row == len(self._generation):
            grow = max(64, row)
            self._generation = np.concatenate([self._generation, np.full(grow, _UNUSABLE, dtype=np.int64)])
            self._cpu = np.concatenate([self._cpu, np.zeros(grow, dtype=np.int64)])
            self._memory = np.concatenate([self._memory, np.zeros(grow, dtype=np.int64)])
            self._order = np.concatenate([self._order, np.zeros(grow)])
            pad = np.zeros((grow, self._capacity.shape[1]), dtype=np.int64)
            self._capacity = np.concatenate([self._capacity, pad])
            self._free = np.concatenate([self._free, pad])
            self._model = np.concatenate([self._model, pad.astype(np.intp)])
            self._enforced = np.concatenate([self._enforced, pad.astype(bool)])
        self._order[row] = placement.node_order([name])[0]
        self._row[name] = row
        self._lookups.clear()  # a remembered lookup may have missed this name
        return row

    def _widen(self, width: int) -> None:
        extra = ((0, 0), (0, width - self._capacity.shape[1]))
        self._capacity = np.pad(self._capacity, extra)
        self._free = np.pad(self._free, extra)
        self._model = np.pad(self._model, extra)
        self._enforced = np.pad(self._enforced, extra)


def _pick(per_row: np.ndarray, index: np.ndarray, missing: bool | float) -> np.ndarray:
    """``per_row`` at ``index``, with ``missing`` where the index is -1."""
    return np.append(per_row, np.array(missing, dtype=per_row.dtype))[index]
