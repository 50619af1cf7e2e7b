"""The verbs: filter, prioritize and preempt answers for kube-scheduler, over the cache and the
placement engine. Bind is :mod:`gpushare.extender.bind`'s; the HTTP side is :mod:`gpushare.extender.server`'s."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import numpy as np
from gpushare.extender import podfit
from gpushare.extender.asks import PodAsk, read_ask
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.filterway import Way, filter_way
from gpushare.extender.nodeview import NodeView, placement_cards
from gpushare.extender.reservations import Gangs
from gpushare.extender.roomwaiters import RoomWaiters, Waiter
from gpushare.extender.wire import NodeNames, Raw, candidate_names, check_victims, refused_nodes, request_pod

from gpushare import placement
from gpushare.contract.errors import ContractError
from gpushare.contract.keycheck import unknown_keys
from gpushare.contract.names import ANN_RETRY
from gpushare.contract.request import pod_key
from gpushare.kube.events import EventRecorder
from gpushare.placement.dra import dra_scores, predict

log = logging.getLogger(__name__)

NO_GPU = placement.Shape(0, 0)


#: the Event reason on a pod for which the extender refused every node it was offered
REFUSAL_EVENT = "GPUUnschedulable"
#: the Event reason on a pod with keys gpushare ignores although they look like its own (a typo)
UNKNOWN_KEYS_EVENT = "GPUShareUnknownKeys"
#: kube-scheduler truncates its FailedScheduling messages to this many characters
EVENT_MESSAGE_LIMIT = 1024


def filter_result(
    engine: PlacementEngine,
    body: Any,
    gangs: Gangs | None = None,
    events: EventRecorder | None = None,
    waiters: RoomWaiters | None = None,
) -> dict[str, Any]:
    """The filter reply. When no node passes, the reason is logged (gangs log their own) and recorded as
    an Event on the pod: kube-scheduler's own FailedScheduling Event folds later messages into the
    first one it wrote for the pod (its events are keyed without the message), so it can go on
    showing a reason that no longer holds. A pod refused for want of room on some nodes, or on nodes that
    can take no GPU pod for now, waits in ``waiters`` (gangs wait there by themselves), to be marked for a
    retry when room frees there."""
    pod = request_pod(body)
    if events is not None and (unknown := unknown_keys(pod)):
        message = limited("; ".join(k.message() for k in unknown))
        events.record(pod, reason=UNKNOWN_KEYS_EVENT, message=message, type_="Warning")
    ask = read_ask(pod)
    names, nodes_mode = candidate_names(body)
    seen = waiters.seen() if waiters is not None else 0
    verdict = _verdict(engine, pod, ask, names, gangs)
    passing, failed, unresolvable, logged = verdict.passing, verdict.failed, verdict.unresolvable, verdict.logged
    refused = refused_nodes(failed, unresolvable)
    if waiters is not None:
        meta = pod.get("metadata") or {}
        if verdict.waits_on and not passing.names:
            waiter = Waiter(meta.get("namespace", ""), meta.get("name", ""), ANN_RETRY, verdict.waits_on)
            waiters.wait(meta.get("uid", ""), waiter, seen)
        else:
            waiters.forget(meta.get("uid", ""))
    if not passing.names and refused:
        message = refusal_message(refused, len(names))
        if not logged:
            log.info("filter pod %s: no node fits: %s", ask.key, message)
        if events is not None:
            events.record(pod, reason=REFUSAL_EVENT, message=message, type_="Warning")
    elif not logged:
        log.info("filter pod %s: %d of %d node(s) fit", ask.key, len(passing), len(names))
    return _filter_reply(passing, nodes_mode, body, failed, unresolvable)


def refusal_message(refused: Mapping[str, str], offered: int) -> str:
    """Each distinct reason once, after the nodes it was given for unless it was given for every node
    offered; at most kube-scheduler's length for an Event message."""
    nodes: dict[str, list[str]] = {}
    for name, reason in sorted(refused.items()):
        nodes.setdefault(reason, []).append(name)
    parts = []
    for reason, names in sorted(nodes.items(), key=lambda item: (-len(item[1]), item[0])):
        if len(names) == offered:
            parts.append(reason)
            continue
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"node{'s' if len(names) > 1 else ''} {shown}: {reason}")
    return limited("; ".join(parts))


def limited(message: str) -> str:
    """``message`` cut to kube-scheduler's length for an Event message."""
    return message if len(message) <= EVENT_MESSAGE_LIMIT else message[: EVENT_MESSAGE_LIMIT - 3] + "..."


@dataclass(frozen=True, slots=True)
class _Verdict:
    """The passing nodes, the failed and the unresolvable ones with their reasons, whether the decision
    was logged already (gangs log their own; a pod without GPUs needs no line), and the refused nodes
    that may take the pod later: for want of room, or for a state of the node that passes (gangs wait
    for room by themselves)."""

    passing: NodeNames
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    logged: bool = False
    waits_on: frozenset[str] = frozenset()


def _verdict(
    engine: PlacementEngine, pod: Mapping[str, Any], ask: PodAsk, names: NodeNames, gangs: Gangs | None
) -> _Verdict:
    """The nodes the pod fits on, decided the one way :func:`filter_way` chooses."""
    engine.cache.expire_holds()
    try:
        way = filter_way(ask, places_gangs=gangs is not None)
    except ContractError as exc:
        reason = str(exc)  # names the pod already
        return _Verdict(NodeNames.of([]), unresolvable=dict.fromkeys(names.names, reason))
    if way is Way.EVERY_NODE:
        return _Verdict(names, logged=True)
    if way is Way.GANG:
        assert gangs is not None
        passing, failed, unresolvable = gangs.filter(pod, ask, names.names)
        return _Verdict(NodeNames.of(passing), failed, unresolvable, logged=True)
    order, rule = ask.order, ask.rule
    if way is Way.EACH_NODE:
        passing, others = [], names.names
    else:
        fit = engine.matrix.fits(names, order.demands[0].shape, rule)
        if way is Way.MATRIX:
            passing = list(compress(names.names, fit.tolist()))
            others = [names.names[i] for i in np.flatnonzero(~fit).tolist()]
        else:  # nodes that run the original device plugin are asked on their own, and refuse it
            passing = [n for n in compress(names.names, fit.tolist()) if not _inferred(engine.cache, n)]
            kept = set(passing)
            others = [n for n in names.names if n not in kept]
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    waits_on: set[str] = set()
    for name in others:
        view = engine.cache.view(name)
        if view is None:
            unresolvable[name] = engine.cache.problem(name) or f"node {name} can't be read"
            waits_on.add(name)
            continue
        nofit = engine.fit(view, order, rule)
        if nofit is None:
            passing.append(name)
        elif engine.fits_empty(view.inventory, order, rule):
            failed[name] = nofit.reason
            waits_on.add(name)
        else:  # no room freed there can hold it: not worth a retry, nor a preemption
            unresolvable[name] = nofit.reason
    return _Verdict(
        names if passing == names.names else NodeNames.of(passing),
        failed,
        unresolvable,
        waits_on=frozenset(waits_on),
    )


def _inferred(cache: ClusterCache, name: str) -> bool:
    view = cache.view(name)
    return view is not None and view.inventory.inferred is not None


def _filter_reply(
    passing: NodeNames, nodes_mode: bool, body: Mapping[str, Any], failed: dict[str, str], unresolvable: dict[str, str]
) -> dict[str, Any]:
    """An unresolvable node is in both maps: kube-scheduler reads ``FailedAndUnresolvableNodes`` first
    (and then preempts nothing for the pod there), while schedulers before it, and any that read only
    ``FailedNodes``, would otherwise show no reason at all (``0/2 nodes are available: .``). ``Error``
    stays empty: kube-scheduler takes an extender's Error for a failed call, shows it instead of any
    node's reason, retries the pod as a scheduler fault and, for an ignorable extender, places the pod
    without it."""
    reply: dict[str, Any] = {
        "FailedNodes": refused_nodes(failed, unresolvable),
        "FailedAndUnresolvableNodes": unresolvable,
        "Error": "",
    }
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
    engine: PlacementEngine, body: Any
) -> tuple[PodAsk, NodeNames, tuple[placement.Demand, ...], str, placement.Policy | None]:
    """The pod's ask, the node names, its GPU demands and its policy (no demands and no policy when the
    pod's request, CPU and memory request or policy can't be read: it then scores 0 everywhere, and
    filter says why)."""
    ask = read_ask(request_pod(body))
    names, _ = candidate_names(body)
    try:
        _ = ask.host
        return ask, names, ask.demands, *engine.policy_for(ask)
    except ContractError:
        return ask, names, (), "", None


def prioritize_result(engine: PlacementEngine, body: Any) -> Raw | list[dict[str, Any]]:
    ask, names, demands, policy_name, policy = _prioritize_args(engine, body)
    if not demands or policy is None:
        return names.priorities(np.zeros(len(names), dtype=np.int64))
    try:
        rule = ask.rule
    except ContractError:
        return names.priorities(np.zeros(len(names), dtype=np.int64))
    if len(demands) == 1 and not (rule.topology and demands[0].cards > 1):
        costs = engine.batch_costs(names, demands[0].shape, policy_name, ask.host, rule)
    else:
        costs = _node_costs(engine, names.names, ask.order, policy, rule)
    return names.priorities(placement.batch_scores(costs))


def host_prioritize_result(engine: PlacementEngine, body: Any) -> Raw | list[dict[str, Any]]:
    """Scores for a pod WITHOUT GPUs (kube-scheduler asks about every pod here). With ``--dra-steering``,
    a pod whose ResourceClaims ask for this driver's cards is scored by :func:`_dra_scores`. Otherwise, under a
    policy that weighs CPU and memory, the nodes where its CPU and memory would strand the least GPU and
    that have the least idle GPU score highest; a node the extender has no cards for counts as having no
    idle GPU. GPU pods, and policies that don't weigh CPU, get 0 everywhere (the GPU entry scores GPU
    pods)."""
    dra = _dra_scores(engine, request_pod(body), candidate_names(body)[0])
    if dra is not None:
        return dra
    ask, names, demands, policy_name, policy = _prioritize_args(engine, body)
    if demands or policy is None or not policy.uses_host:
        return names.priorities(np.zeros(len(names), dtype=np.int64))
    costs = engine.batch_costs(names, NO_GPU, policy_name, ask.host)
    scores = placement.batch_scores(np.where(np.isfinite(costs), costs, 0.0))
    if len(names):
        best = int(np.argmax(scores))
        log.info("host prioritize pod %s: node %s scores best of %d", ask.key, names.names[best], len(names))
    return names.priorities(scores)


def _dra_scores(engine: PlacementEngine, pod: Mapping[str, Any], names: NodeNames) -> Raw | list[dict[str, Any]] | None:
    """Scores for a pod whose ResourceClaims ask kube-scheduler's DRA allocator for this driver's cards:
    per node, the cards the allocator would take there (its first fit), the nodes where they are left
    with the least free memory scoring highest (:func:`gpushare.placement.dra.dra_scores`). 0 everywhere
    when the claims can't be predicted (not listed yet, allocated already, selectors...); None for a pod
    without claims of this driver, and without ``--dra-steering``."""
    view = engine.cache.dra
    if view is None or not (pod.get("spec") or {}).get("resourceClaims"):
        return None
    try:
        requests = view.requests(pod)
    except ContractError as exc:
        log.info("DRA prioritize: 0 on every node: %s", exc)  # the error names the pod
        return names.priorities(np.zeros(len(names), dtype=np.int64))
    if not requests:
        return None
    fits = [predict(view.cards(name), requests) for name in names.names]
    scores = dra_scores(fits)
    best = int(np.argmax(scores)) if len(names) else 0
    fit = fits[best] if len(names) else None
    if fit is None:
        log.info("DRA prioritize pod %s: its claims fit on none of %d node(s)", pod_key(pod), len(names))
    else:
        log.info(
            "DRA prioritize pod %s: node %s scores best of %d, the allocator would take %s there (%d MiB left)",
            pod_key(pod),
            names.names[best],
            len(names),
            ", ".join(fit.devices),
            fit.left >> 20,
        )
    return names.priorities(scores)


def _node_costs(
    engine: PlacementEngine,
    names: Sequence[str],
    order: podfit.InitOrder,
    policy: placement.Policy,
    rule: placement.CardRule,
) -> np.ndarray:
    """Per node, one at a time: for pods with several GPU containers, or whose cards must be NVLink
    peers or share a NUMA node (``inf`` where the pod can't go)."""
    costs = np.full(len(names), np.inf)
    for i, node in enumerate(names):
        view = engine.cache.view(node)
        if view is None:
            continue
        try:
            costs[i] = engine.cost(view, order, policy, rule)
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


def _needed_victims(
    view: NodeView, victims: list[str], order: podfit.InitOrder, rule: placement.CardRule
) -> list[str] | None:
    """The fewest of ``victims`` whose eviction lets the preemptor fit on the node (the later victims
    are tried for removal first), or None when evicting them all is not enough."""
    extra = [held for _, held in view.assumed]

    def fits_without(evicted: set[str]) -> bool:
        remaining = [p for p in view.pods if (p.get("metadata") or {}).get("uid") not in evicted]
        cards = placement_cards(view.inventory, remaining, extra, view.fenced, view.ledger, view.requests)
        return not order.demands or order.fit(cards, view.inventory.unit.name, rule) is None

    needed = set(victims)
    if not fits_without(needed):
        return None
    for uid in reversed(victims):
        if fits_without(needed - {uid}):
            needed.discard(uid)
    return [uid for uid in victims if uid in needed]


def preempt_result(engine: PlacementEngine, body: Any) -> dict[str, Any]:
    """Keep the nodes where evicting the victims frees cards that fit the preemptor, with only the
    victims that are needed."""
    ask = read_ask(request_pod(body))
    check_victims(body)
    try:
        order = ask.order
        if ask.gang is not None:  # evicting pods for one member can't place its gang
            return {"NodeNameToMetaVictims": {}}
        rule = ask.rule
    except ContractError:
        return {"NodeNameToMetaVictims": {}}
    names = sorted(set(body.get("NodeNameToMetaVictims") or {}) | set(body.get("NodeNameToVictims") or {}))
    result: dict[str, Any] = {}
    for name in names:
        view = engine.cache.view(name)
        needed = None if view is None else _needed_victims(view, _victim_uids(body, name), order, rule)
        if needed is not None:
            result[name] = {"Pods": [{"UID": uid} for uid in needed], "NumPDBViolations": _pdb_violations(body, name)}
    return {"NodeNameToMetaVictims": result}
