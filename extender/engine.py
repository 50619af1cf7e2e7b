"""The placement engine: the policy each pod is placed by, and per-node answers memoised by (node
generation, demand shape, policy), so a node nothing happened to since the last pod of the same shape
costs one dict lookup."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from gpushare.extender import podfit
from gpushare.extender.asks import PodAsk
from gpushare.extender.cache import ClusterCache
from gpushare.extender.matrix import NodeMatrix
from gpushare.extender.nodeview import NodeView
from gpushare.extender.wire import NodeNames

from gpushare import placement
from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import ANN_POLICY
from gpushare.placement.memo import CostMemo

log = logging.getLogger(__name__)


MEMO_LIMIT = 200_000
#: distinct (policy, demand shape, CPU/memory request) whose per-node costs are kept
BATCH_MEMO_LIMIT = 256
WORKLOAD_DRIFT = 20
#: policies built from the workload the cache has observed
LEARNED = ("fgd", "fgdfit")

BatchKey = tuple[str, placement.Shape, tuple[int, int], placement.CardRule]
OrderKey = tuple[tuple[placement.Shape, ...], ...]


class PlacementEngine:
    """Policy choice and memoised per-node answers."""

    def __init__(self, cache: ClusterCache, default_policy: str) -> None:
        if default_policy not in placement.POLICIES:
            raise ValueError(f"unknown policy {default_policy!r}; choose from {sorted(placement.POLICIES)}")
        self.cache = cache
        self.default_policy = default_policy
        self.matrix = NodeMatrix(cache)
        self._lock = threading.Lock()
        self._fits: dict[tuple[str, int, OrderKey, placement.CardRule], placement.NoFit | None] = {}
        self._empty_fits: dict[tuple[NodeInventory, OrderKey, placement.CardRule], bool] = {}
        self._costs: dict[tuple[str, int, OrderKey, placement.Policy, placement.CardRule], float] = {}
        self._batch_costs: dict[BatchKey, tuple[placement.Policy, CostMemo]] = {}
        self._learned: dict[str, placement.Policy] = {name: placement.POLICIES[name] for name in LEARNED}
        #: the cache's shapes_version and number of observed demands the fgd workload was built from
        self._fgd_built = (-1, 0)
        self._fgd_rebuilding = False

    def policy_for(self, ask: PodAsk) -> tuple[str, placement.Policy]:
        """The pod's own policy annotation wins over the cluster-wide default."""
        name = ask.policy or self.default_policy
        if name not in placement.POLICIES:
            raise ContractError(f"pod {ask.key} annotation {ANN_POLICY}: unknown policy {name!r}")
        with self._lock:
            return name, self._policy(name)

    def _policy(self, name: str) -> placement.Policy:
        """The policy called ``name`` as it is now; under the lock."""
        return self._learned_policies()[name] if name in LEARNED else placement.POLICIES[name]

    def warm(self) -> None:
        """Build every node's row, and the default policy's costs on every node for the demand shapes
        seen so far (the most common first), so that the first pods don't pay for them."""
        self.matrix.refresh()
        names = NodeNames.of(self.cache.node_names())
        for shape, _ in Counter(self.cache.observed_shapes()).most_common(BATCH_MEMO_LIMIT):
            self.batch_costs(names, shape, self.default_policy)

    def _learned_policies(self) -> dict[str, placement.Policy]:
        """The fragmentation-aware policies with the workload observed so far; under the lock.

        The workload is rebuilt once the observed demands changed by a twentieth since the last build:
        rebuilding it on every pod would recompute every node's cost on every pod, and typical
        shapes don't move that fast. After the first build, a rebuild runs in the background together
        with the costs of the shapes in use (some 10 ms each at 5,000 nodes), and the workload built
        before goes on answering until both are ready, so no pod waits for them.
        """
        version = self.cache.shapes_version
        built_version, built_count = self._fgd_built
        if built_version < 0:
            self._learned, self._fgd_built = self._build_fgd()
        elif version - built_version > built_count // WORKLOAD_DRIFT and not self._fgd_rebuilding:
            self._fgd_rebuilding = True
            threading.Thread(target=self._rebuild_fgd, name="fgd-rebuild", daemon=True).start()
        return self._learned

    def _build_fgd(self) -> tuple[dict[str, placement.Policy], tuple[int, int]]:
        version = self.cache.shapes_version
        shapes = self.cache.observed_shapes()
        fgd = placement.Fgd(placement.Workload.from_shapes(shapes) if shapes else None)
        fgdfit = placement.FgdFit.of(self.cache.observed_pod_shapes())
        return {"fgd": fgd, "fgdfit": fgdfit}, (version, len(shapes))

    def _rebuild_fgd(self) -> None:
        try:
            policies, built = self._build_fgd()
            with self._lock:
                keys = [key for key in self._batch_costs if key[0] in LEARNED]
            memos = {key: self.matrix.memo(policies[key[0]], key[1], key[2], key[3]) for key in keys}
            with self._lock:
                self._learned, self._fgd_built = policies, built
                for key, memo in memos.items():
                    self._batch_costs[key] = (policies[key[0]], memo)
        except Exception:
            log.exception("rebuilding the fragmentation-aware policy's workload failed; the previous one stays")
        finally:
            with self._lock:
                self._fgd_rebuilding = False

    def fit(
        self, view: NodeView, order: podfit.InitOrder, rule: placement.CardRule = placement.ANY_CARD
    ) -> placement.NoFit | None:
        """Why the pod's demands, in their ``order``, don't fit on the node's cards, or None."""
        if view.inventory.inferred is not None and (refusal := podfit.original_plugin_refusal(order.demands)):
            return placement.NoFit(f"node {view.name} {refusal}")
        key = (view.name, view.generation, order.key, rule)
        return _memoised(self._fits, key, lambda: order.fit(view.cards, view.inventory.unit.name, rule))

    def fits_empty(
        self, inventory: NodeInventory, order: podfit.InitOrder, rule: placement.CardRule = placement.ANY_CARD
    ) -> bool:
        """Whether the pod would fit on these cards were they all empty and healthy: if not, no pod ending
        there and no preemption makes room for it, only other cards would."""
        if inventory.inferred is not None and podfit.original_plugin_refusal(order.demands):
            return False
        empty = tuple(placement.CardCapacity.of(card, inventory.units_of(card)) for card in inventory.cards)
        key = (inventory, order.key, rule)
        return _memoised(self._empty_fits, key, lambda: order.fit(empty, inventory.unit.name, rule) is None)

    def cost(
        self,
        view: NodeView,
        order: podfit.InitOrder,
        policy: placement.Policy,
        rule: placement.CardRule = placement.ANY_CARD,
    ) -> float:
        """The policy's cost of the pod on the node; raises NoFit."""
        key = (view.name, view.generation, order.key, policy, rule)
        return _memoised(self._costs, key, lambda: order.cost(view.cards, policy, view.inventory.unit.name, rule))

    def batch_costs(
        self,
        names: NodeNames,
        shape: placement.Shape,
        name: str,
        request: tuple[int, int] = (0, 0),
        rule: placement.CardRule = placement.ANY_CARD,
    ) -> np.ndarray:
        """Per node of ``names``: the cost of one demand of ``shape`` under the policy called ``name`` as
        it is now, for a pod requesting ``request`` (CPU milli, memory bytes) whose ``rule`` picks card
        models (``inf`` where it can't go). A rule's topology is not looked at: one card has none, and
        multi-card pods that require one are rated per node."""
        with self._lock:
            policy = self._policy(name)
            key = (name, shape, request if policy.uses_host else (0, 0), rule.without_topology())
            held = self._batch_costs.get(key)
            if held is None or held[0] is not policy:
                if len(self._batch_costs) >= BATCH_MEMO_LIMIT:
                    self._batch_costs.clear()
                held = (policy, CostMemo())
                self._batch_costs[key] = held
        return self.matrix.costs(names, held[1], policy, shape, key[2], key[3])


def _memoised(memo: dict, key: Any, compute: Callable[[], Any]) -> Any:
    """``memo[key]``, computed first if missing (an exception is not kept). Entries of old generations
    are never read again; the memo starts over rather than grow without bound."""
    try:
        return memo[key]
    except KeyError:
        value = compute()
        if len(memo) >= MEMO_LIMIT:
            memo.clear()
        memo[key] = value
        return value
