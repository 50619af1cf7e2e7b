"""Per-node values memoised by node generation: only nodes that changed since are computed again."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpushare.placement.batch import batch_costs
from gpushare.placement.demand import Shape
from gpushare.placement.policies import NodeHosts, Policy

#: the generation of a row whose value was never computed (or whose node can't be placed on)
UNKNOWN = -1


class RowMemo:
    """One value per row (node), with the generation each was computed at."""

    def __init__(self, missing: float = np.inf) -> None:
        self._missing = missing
        self._value = np.zeros(0)
        self._generation = np.zeros(0, dtype=np.int64)

    def values(self, generation: np.ndarray, compute: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Per row of ``generation``: the value, calling ``compute(stale row numbers)`` for rows whose
        generation moved. The result is the memo's own array: read it before the memo is asked again."""
        rows = len(generation)
        if rows > len(self._value):
            grow = max(rows, 2 * len(self._value)) - len(self._value)
            self._value = np.concatenate([self._value, np.full(grow, self._missing)])
            self._generation = np.concatenate([self._generation, np.full(grow, UNKNOWN, dtype=np.int64)])
        stale = np.flatnonzero(self._generation[:rows] != generation)
        if stale.size:
            self._value[stale] = compute(stale)
            self._generation[stale] = generation[stale]
        return self._value[:rows]


class CostMemo(RowMemo):
    """One policy's node costs for one demand shape and CPU/memory request, per row; only rows whose
    node changed since are computed again. How the prioritize verb and the trace replay both get costs."""

    def costs(
        self,
        capacity: np.ndarray,
        free: np.ndarray,
        generation: np.ndarray,
        host: NodeHosts,
        policy: Policy,
        shape: Shape,
        request: tuple[int, int] = (0, 0),
        allowed: np.ndarray | None = None,
    ) -> np.ndarray:
        """Per row: the policy's cost of the demand (``inf`` where it doesn't fit); ``host`` says per row
        what lies beside the GPUs; ``allowed`` the cards the pod's rule admits (None:
        all). The result is the memo's own array: read it before the memo is asked again."""
        return self.values(
            generation,
            lambda stale: batch_costs(
                policy,
                capacity[stale],
                free[stale],
                shape,
                host.rows(stale),
                request,
                None if allowed is None else allowed[stale],
            ),
        )
