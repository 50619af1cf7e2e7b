"""The cache's nodes as numpy rows, so filter and prioritize over thousands of nodes are array maths.

Each known node owns one row: its cards' capacity and free units (0 for unhealthy or absent cards)
and the generation they were read at. Rows are refreshed lazily: the cache reports which nodes
changed, and the next query re-reads only those.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from extender.cache import ClusterCache
from gpushare import placement

_INITIAL_WIDTH = 8


@dataclass(frozen=True, slots=True)
class Rows:
    """A copy of the rows of some nodes, in the order they were asked for.

    ``row`` is each node's row number (-1 for nodes the extender can't place on: unknown, or
    without a usable inventory); the arrays of those nodes hold zeros.
    """

    row: np.ndarray
    capacity: np.ndarray
    free: np.ndarray
    generation: np.ndarray

    @property
    def known(self) -> np.ndarray:
        return self.row >= 0


def fits(rows: Rows, shape: placement.Shape) -> np.ndarray:
    """Per node: whether one demand of ``shape`` fits on its cards (the same test as check_fit)."""
    need = rows.capacity if shape.exclusive else shape.units
    able = (rows.capacity > 0) & (rows.free >= need)
    return rows.known & (able.sum(axis=1) >= shape.cards)


class NodeMatrix:
    def __init__(self, cache: ClusterCache) -> None:
        self._cache = cache
        self._lock = threading.Lock()
        self._row: dict[str, int] = {}
        self._usable = np.zeros(0, dtype=bool)
        self._capacity = np.zeros((0, _INITIAL_WIDTH), dtype=np.int64)
        self._free = np.zeros((0, _INITIAL_WIDTH), dtype=np.int64)
        self._generation = np.zeros(0, dtype=np.int64)
        self._dirty: set[str] = set()
        self._dirty_lock = threading.Lock()
        self._last_names: tuple[str, ...] = ()
        self._last_index = np.zeros(0, dtype=np.intp)
        cache.add_change_listener(self._changed)

    def _changed(self, node: str) -> None:
        # Called under the cache's lock: only the dirty set's own lock may be taken here.
        with self._dirty_lock:
            self._dirty.add(node)

    def rows(self, names: Sequence[str]) -> Rows:
        with self._lock:
            self._refresh()
            index = self._index(names)
            found = index >= 0
            index[found] = np.where(self._usable[index[found]], index[found], -1)
            safe = np.maximum(index, 0)
            present = index >= 0
            width = self._capacity.shape[1]
            if not len(self._row):
                zeros = np.zeros((len(names), width), dtype=np.int64)
                return Rows(index, zeros, zeros.copy(), np.full(len(names), -1, dtype=np.int64))
            return Rows(
                row=index,
                capacity=np.where(present[:, None], self._capacity[safe], 0),
                free=np.where(present[:, None], self._free[safe], 0),
                generation=np.where(present, self._generation[safe], -1),
            )

    def _index(self, names: Sequence[str]) -> np.ndarray:
        """Row numbers of ``names`` (-1 for unknown names). kube-scheduler asks about the same list of
        nodes again and again, so the last answer is kept; comparing lists is far cheaper than looking
        every name up again."""
        key = tuple(names)
        if key != self._last_names:
            self._last_names = key
            self._last_index = np.fromiter(map(self._row.get, key, repeat(-1)), dtype=np.intp, count=len(key))
        return self._last_index.copy()

    def _refresh(self) -> None:
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        for name in dirty:
            row = self._row.get(name)
            if row is None:
                row = self._add_row(name)
            view = self._cache.view(name)
            if view is None:
                self._usable[row] = False
                self._capacity[row] = 0
                self._free[row] = 0
                continue
            if len(view.cards) > self._capacity.shape[1]:
                self._widen(len(view.cards))
            self._capacity[row] = 0
            self._free[row] = 0
            for pos, card in enumerate(view.cards):
                self._capacity[row, pos] = card.capacity if card.healthy else 0
                self._free[row, pos] = card.free
            self._generation[row] = view.generation
            self._usable[row] = True

    def _add_row(self, name: str) -> int:
        row = len(self._row)
        if row == len(self._generation):
            grow = max(64, row)
            self._usable = np.concatenate([self._usable, np.zeros(grow, dtype=bool)])
            self._generation = np.concatenate([self._generation, np.full(grow, -1, dtype=np.int64)])
            pad = np.zeros((grow, self._capacity.shape[1]), dtype=np.int64)
            self._capacity = np.concatenate([self._capacity, pad])
            self._free = np.concatenate([self._free, pad])
        self._row[name] = row
        self._last_names = ()  # the remembered lookup may have missed this name
        return row

    def _widen(self, width: int) -> None:
        extra = ((0, 0), (0, width - self._capacity.shape[1]))
        self._capacity = np.pad(self._capacity, extra)
        self._free = np.pad(self._free, extra)


class CostMemo:
    """One policy's node costs for one demand shape, per row, with the generation each was computed
    at; only rows whose node changed since are computed again."""

    def __init__(self) -> None:
        self._cost = np.zeros(0)
        self._generation = np.zeros(0, dtype=np.int64)

    def costs(self, rows: Rows, policy: placement.Policy, shape: placement.Shape) -> np.ndarray:
        """Per node: the policy's cost of the demand (``inf`` where it doesn't fit or is unknown)."""
        top = int(rows.row.max()) + 1 if len(rows.row) else 0
        if top > len(self._cost):
            size = max(top, 2 * len(self._cost))
            self._cost = np.concatenate([self._cost, np.full(size - len(self._cost), np.inf)])
            self._generation = np.concatenate([self._generation, np.full(size - len(self._generation), -1)])
        known = rows.known
        safe = np.maximum(rows.row, 0)
        stale = known & (self._generation[safe] != rows.generation)
        if stale.any():
            fresh = placement.batch_place(policy, rows.capacity[stale], rows.free[stale], shape).cost
            self._cost[rows.row[stale]] = fresh
            self._generation[rows.row[stale]] = rows.generation[stale]
        return np.where(known, self._cost[safe], np.inf)
