"""filter, prioritize and preempt over the cache. Bodies use kube-scheduler's Go field names exactly.

Per-node answers are memoised by (node generation, demand shape, policy), so a node nothing happened
to since the last pod of the same shape costs one dict lookup.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import compress
from typing import Any

import numpy as np

from extender import podfit
from extender.cache import ClusterCache, NodeView, demands_of, host_request, placement_cards
from extender.matrix import CostMemo, NodeMatrix
from extender.wire import NodeNames, Raw
from gpushare import placement
from gpushare.contract import ANN_POLICY, ContractError, annotations_of, pod_key

log = logging.getLogger(__name__)


MEMO_LIMIT = 200_000
#: distinct (policy, demand shape, CPU/memory request) whose per-node costs are kept
BATCH_MEMO_LIMIT = 256
WORKLOAD_DRIFT = 20
#: policies built from the workload the cache has observed
LEARNED = ("fgd", "fgdfit")
NO_GPU = placement.Shape(0, 0)

BatchKey = tuple[str, placement.Shape, tuple[int, int]]


class BadRequest(ValueError):
    """The body isn't an extender request: HTTP 400."""


def _expect(value: Any, kind: type, where: str) -> Any:
    """``value`` when it is absent or of ``kind``; BadRequest naming the field otherwise."""
    if value is not None and not isinstance(value, kind):
        raise BadRequest(f"{where} must be {'an object' if kind is dict else 'a list' if kind is list else 'a string'}")
    return value


def _check_pod(pod: Mapping[str, Any]) -> None:
    """Every field of the pod the verbs read has the type the API would give it."""
    meta = _expect(pod.get("metadata"), dict, "Pod.metadata") or {}
    for field in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp"):
        _expect(meta.get(field), str, f"Pod.metadata.{field}")
    for field in ("annotations", "labels"):
        for value in (_expect(meta.get(field), dict, f"Pod.metadata.{field}") or {}).values():
            _expect(value, str, f"Pod.metadata.{field} values")
    spec = _expect(pod.get("spec"), dict, "Pod.spec") or {}
    _expect(pod.get("status"), dict, "Pod.status")
    _expect(spec.get("nodeSelector"), dict, "Pod.spec.nodeSelector")
    for group in ("initContainers", "containers"):
        for item in _expect(spec.get(group), list, f"Pod.spec.{group}") or []:
            where = f"Pod.spec.{group}[]"
            resources = _expect(_expect(item, dict, where).get("resources"), dict, f"{where}.resources") or {}
            _expect(item.get("name"), str, f"{where}.name")
            _expect(resources.get("limits"), dict, f"{where}.resources.limits")
            _expect(resources.get("requests"), dict, f"{where}.resources.requests")


def _check_victims(body: Mapping[str, Any]) -> None:
    for field, inner, kind in (("NodeNameToMetaVictims", "UID", str), ("NodeNameToVictims", "metadata", dict)):
        for entry in (_expect(body.get(field), dict, field) or {}).values():
            for victim in _expect(_expect(entry, dict, f"{field} entries").get("Pods"), list, f"{field}[].Pods") or []:
                _expect(_expect(victim, dict, f"{field}[].Pods[]").get(inner), kind, f"{field}[].Pods[].{inner}")


def request_pod(body: Any) -> Mapping[str, Any]:
    """The request's pod, its shape checked (BadRequest names the first field that is wrong)."""
    if not isinstance(body, dict) or not isinstance(body.get("Pod"), dict):
        raise BadRequest("the body must be a JSON object with a Pod")
    _check_pod(body["Pod"])
    return body["Pod"]


def candidate_names(body: Mapping[str, Any]) -> tuple[NodeNames, bool]:
    """Node names from ``NodeNames`` (nodeCacheCapable) or ``Nodes.items``; and whether Nodes was used."""
    if body.get("NodeNames") is not None:
        names = body["NodeNames"]
        if isinstance(names, list):
            with contextlib.suppress(TypeError):  # an item that is not a string
                return NodeNames.of(names), False
        raise BadRequest("NodeNames must be a list of strings")
    nodes = body.get("Nodes")
    if isinstance(nodes, dict):
        items = _expect(nodes.get("items"), list, "Nodes.items") or []
        metas = [
            _expect(_expect(n, dict, "Nodes.items[]").get("metadata"), dict, "Nodes.items[].metadata") for n in items
        ]
        names = [_expect((m or {}).get("name", ""), str, "Nodes.items[].metadata.name") for m in metas]
        return NodeNames.of(names), True
    raise BadRequest("the body must carry NodeNames or Nodes")


class Placement:
    """Policy choice and memoised per-node answers."""

    def __init__(self, cache: ClusterCache, default_policy: str) -> None:
        if default_policy not in placement.POLICIES:
            raise ValueError(f"unknown policy {default_policy!r}; choose from {sorted(placement.POLICIES)}")
        self.cache = cache
        self.default_policy = default_policy
        self.matrix = NodeMatrix(cache)
        self._lock = threading.Lock()
        self._fits: dict[tuple[str, int, tuple[placement.Shape, ...]], placement.NoFit | None] = {}
        self._costs: dict[tuple[str, int, tuple[placement.Shape, ...], placement.Policy], float] = {}
        self._batch_costs: dict[BatchKey, tuple[placement.Policy, CostMemo]] = {}
        self._learned: dict[str, placement.Policy] = {name: placement.POLICIES[name] for name in LEARNED}
        #: the cache's shapes_version and number of observed demands the fgd workload was built from
        self._fgd_built = (-1, 0)
        self._fgd_rebuilding = False

    def policy_for(self, pod: Mapping[str, Any]) -> tuple[str, placement.Policy]:
        """The pod's own policy annotation wins over the cluster-wide default."""
        name = annotations_of(pod).get(ANN_POLICY) or self.default_policy
        if name not in placement.POLICIES:
            raise ContractError(f"pod {pod_key(pod)} annotation {ANN_POLICY}: unknown policy {name!r}")
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
            memos = {key: self.matrix.memo(policies[key[0]], key[1], key[2]) for key in keys}
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
        self, view: NodeView, demands: Sequence[placement.Demand], init: frozenset[str] = frozenset()
    ) -> placement.NoFit | None:
        if view.inventory.inferred is not None and (refusal := podfit.original_plugin_refusal(demands)):
            return placement.NoFit(f"node {view.name} {refusal}")
        if podfit.has_init(demands, init):
            return podfit.fit(view.cards, demands, init, view.inventory.unit.name)
        key = (view.name, view.generation, placement.shape_key(list(demands)))
        try:
            return self._fits[key]
        except KeyError:
            result = placement.check_fit(view.cards, demands, unit=view.inventory.unit.name)
            _remember(self._fits, key, result)
            return result

    def cost(
        self,
        view: NodeView,
        demands: Sequence[placement.Demand],
        policy: placement.Policy,
        init: frozenset[str] = frozenset(),
    ) -> float:
        if podfit.has_init(demands, init):
            return podfit.cost(view.cards, demands, init, policy, view.inventory.unit.name)
        key = (view.name, view.generation, placement.shape_key(list(demands)), policy)
        try:
            return self._costs[key]
        except KeyError:
            cost = placement.node_cost(view.cards, demands, policy, unit=view.inventory.unit.name)
            _remember(self._costs, key, cost)
            return cost

    def batch_costs(
        self, names: NodeNames, shape: placement.Shape, name: str, request: tuple[int, int] = (0, 0)
    ) -> np.ndarray:
        """Per node of ``names``: the cost of one demand of ``shape`` under the policy called ``name`` as
        it is now, for a pod requesting ``request`` (CPU milli, memory bytes; ``inf`` where it can't go)."""
        with self._lock:
            policy = self._policy(name)
            key = (name, shape, request if policy.uses_host else (0, 0))
            held = self._batch_costs.get(key)
            if held is None or held[0] is not policy:
                if len(self._batch_costs) >= BATCH_MEMO_LIMIT:
                    self._batch_costs.clear()
                held = (policy, CostMemo())
                self._batch_costs[key] = held
        return self.matrix.costs(names, held[1], policy, shape, key[2])


def _remember(memo: dict, key: Any, value: Any) -> None:
    """Entries of old generations are never read again; start over rather than grow without bound."""
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = value


def filter_result(engine: Placement, body: Any) -> dict[str, Any]:
    pod = request_pod(body)
    names, nodes_mode = candidate_names(body)
    try:
        demands = demands_of(pod)
        init = podfit.init_names(pod)
    except (ContractError, ValueError) as exc:
        reason = str(exc)  # names the pod already
        return _filter_reply(NodeNames.of([]), nodes_mode, body, {}, dict.fromkeys(names.names, reason))
    if not demands:
        return _filter_reply(names, nodes_mode, body, {}, {})
    if len(demands) == 1 and podfit.original_plugin_refusal(demands) is None:
        # one shared single-card container: the node matrix answers, on every kind of node
        fit = engine.matrix.fits(names, demands[0].shape)
        passing = list(compress(names.names, fit.tolist()))
        others = [names.names[i] for i in np.flatnonzero(~fit).tolist()]
    elif len(demands) == 1:
        fit = engine.matrix.fits(names, demands[0].shape)
        passing = [n for n in compress(names.names, fit.tolist()) if not _inferred(engine.cache, n)]
        kept = set(passing)
        others = [n for n in names.names if n not in kept]
    else:
        passing, others = [], names.names
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    for name in others:
        view = engine.cache.view(name)
        if view is None:
            unresolvable[name] = f"node {name} {engine.cache.problem(name)}"
            continue
        nofit = engine.fit(view, demands, init)
        if nofit is None:
            passing.append(name)
        else:
            failed[name] = nofit.reason
    log.info("filter pod %s: %d of %d node(s) fit", pod_key(pod), len(passing), len(names))
    kept = names if passing == names.names else NodeNames.of(passing)
    return _filter_reply(kept, nodes_mode, body, failed, unresolvable)


def _inferred(cache: ClusterCache, name: str) -> bool:
    view = cache.view(name)
    return view is not None and view.inventory.inferred is not None


def _filter_reply(
    passing: NodeNames, nodes_mode: bool, body: Mapping[str, Any], failed: dict[str, str], unresolvable: dict[str, str]
) -> dict[str, Any]:
    reply: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": ""}
    if nodes_mode:
        keep = set(passing.names)
        items = [n for n in body["Nodes"].get("items") or [] if (n.get("metadata") or {}).get("name") in keep]
        reply["Nodes"] = {**body["Nodes"], "items": items}
        reply["NodeNames"] = None
    else:
        reply["NodeNames"] = passing.json()
        reply["Nodes"] = None
    return reply


def _prioritize_args(
    engine: Placement, body: Any
) -> tuple[Mapping[str, Any], NodeNames, tuple[placement.Demand, ...], str, placement.Policy | None]:
    """The pod, the node names, its GPU demands and its policy (no demands and no policy when the pod's
    request or policy can't be read: it then scores 0 everywhere, and filter says why)."""
    pod = request_pod(body)
    names, _ = candidate_names(body)
    try:
        return pod, names, demands_of(pod), *engine.policy_for(pod)
    except (ContractError, ValueError):
        return pod, names, (), "", None


def prioritize_result(engine: Placement, body: Any) -> Raw | list[dict[str, Any]]:
    pod, names, demands, policy_name, policy = _prioritize_args(engine, body)
    if not demands or policy is None:
        return names.priorities(np.zeros(len(names), dtype=np.int64))
    if len(demands) == 1:
        costs = engine.batch_costs(names, demands[0].shape, policy_name, host_request(pod))
    else:
        costs = _node_costs(engine, names.names, demands, policy, podfit.init_names(pod))
    return names.priorities(placement.batch_scores(costs))


def host_prioritize_result(engine: Placement, body: Any) -> Raw | list[dict[str, Any]]:
    """Scores for a pod WITHOUT GPUs (kube-scheduler asks about every pod here): under a policy that
    weighs CPU and memory, the nodes where its CPU and memory would strand the least GPU and that have
    the least idle GPU score highest; a node the extender has no cards for counts as having no idle GPU.
    GPU pods, and policies that don't weigh CPU, get 0 everywhere (the GPU entry scores GPU pods)."""
    pod, names, demands, policy_name, policy = _prioritize_args(engine, body)
    if demands or policy is None or not policy.uses_host:
        return names.priorities(np.zeros(len(names), dtype=np.int64))
    costs = engine.batch_costs(names, NO_GPU, policy_name, host_request(pod))
    scores = placement.batch_scores(np.where(np.isfinite(costs), costs, 0.0))
    if len(names):
        best = int(np.argmax(scores))
        log.info("host prioritize pod %s: node %s scores best of %d", pod_key(pod), names.names[best], len(names))
    return names.priorities(scores)


def _node_costs(
    engine: Placement,
    names: Sequence[str],
    demands: Sequence[placement.Demand],
    policy: placement.Policy,
    init: frozenset[str],
) -> np.ndarray:
    """Per node, one at a time: for pods with several GPU containers (``inf`` where the pod can't go)."""
    costs = np.full(len(names), np.inf)
    for i, node in enumerate(names):
        view = engine.cache.view(node)
        if view is None:
            continue
        try:
            costs[i] = engine.cost(view, demands, policy, init)
        except placement.NoFit:
            continue
    return costs


def _victim_uids(body: Mapping[str, Any], name: str) -> list[str]:
    meta = (body.get("NodeNameToMetaVictims") or {}).get(name)
    if meta is not None:
        return [p.get("UID", "") for p in meta.get("Pods") or []]
    full = (body.get("NodeNameToVictims") or {}).get(name) or {}
    return [(p.get("metadata") or {}).get("uid", "") for p in full.get("Pods") or []]


def _pdb_violations(body: Mapping[str, Any], name: str) -> int:
    entry = (body.get("NodeNameToMetaVictims") or body.get("NodeNameToVictims") or {}).get(name) or {}
    return int(entry.get("NumPDBViolations") or 0)


def preempt_result(engine: Placement, body: Any) -> dict[str, Any]:
    """Keep the nodes where evicting the victims frees cards that fit the preemptor, with only the
    victims that are needed (the later victims are tried for removal first)."""
    pod = request_pod(body)
    _check_victims(body)
    try:
        demands = demands_of(pod)
        init = podfit.init_names(pod)
    except (ContractError, ValueError):
        return {"NodeNameToMetaVictims": {}}
    names = sorted(set(body.get("NodeNameToMetaVictims") or {}) | set(body.get("NodeNameToVictims") or {}))
    result: dict[str, Any] = {}
    for name in names:
        view = engine.cache.view(name)
        if view is None:
            continue
        victims = _victim_uids(body, name)
        pods = engine.cache.pods_on(name)
        extra = [held for _, held in engine.cache.assumed_on(name)]
        fenced = engine.cache.fenced(name)

        def fits_without(
            evicted: set[str], view: NodeView = view, pods: list = pods, extra: list = extra, fenced: frozenset = fenced
        ) -> bool:
            remaining = [p for p in pods if (p.get("metadata") or {}).get("uid") not in evicted]
            cards = placement_cards(view.inventory, remaining, extra, fenced)
            return not demands or podfit.fit(cards, demands, init, view.inventory.unit.name) is None

        needed = set(victims)
        if not fits_without(needed):
            continue
        for uid in reversed(victims):
            if fits_without(needed - {uid}):
                needed.discard(uid)
        result[name] = {
            "Pods": [{"UID": uid} for uid in victims if uid in needed],
            "NumPDBViolations": _pdb_violations(body, name),
        }
    return {"NodeNameToMetaVictims": result}
