"""Gangs in the extender: the filter verb for a pod labelled with a gang, and the holds that set a plan's
cards aside on the nodes until its members are bound.

A member's filter finds the gang's members in the pod cache. With fewer than the gang's minimum
present, or fewer placeable at once (:func:`gpushare.placement.gangplan.plan_gang`; bound members count as
placed), every node is refused with the counts and the gang's holds are released. Otherwise the plan is
written as holds (pending-bind entries tagged with the gang, for members not bound yet) into the nodes'
``gpushare.io/pending-binds`` annotation, each node by the same compare-and-swap, against the same fresh
reads, as a bind; only then does the filter pass the member's planned node. If a node refuses its holds
(another writer changed the gang's holds there, or its cards are gone), the holds already written are
taken back and the member waits for the next try. Bind binds a gang member only onto cards held for it.

Once the holds are written, the gang's other unbound members get ``gpushare.io/gang-hold: <node>``
(and lose it when the holds are released): kube-scheduler retries a Pending pod at once when the pod
itself changes, but not when a node's annotations do, so without it they would wait for its periodic
flush of unschedulable pods (5 minutes; 60 s in 1.20).

For the same reason a gang refused for want of room waits in :class:`gpushare.extender.roomwaiters.RoomWaiters`:
when the pod watch shows a bound pod ending or going (room may have come free), the member refused last
gets ``gpushare.io/gang-retry``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from gpushare.extender.asks import PodAsk
from gpushare.extender.bind import ATTEMPTS, Binder
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from gpushare.extender.nodeview import NodeView
from gpushare.extender.roomwaiters import RoomWaiters, Waiter

from gpushare import placement
from gpushare.contract.errors import ContractError
from gpushare.contract.gang import Gang
from gpushare.contract.names import ANN_GANG_HOLD, ANN_GANG_RETRY, NODE_ANN_PENDING_BINDS
from gpushare.contract.nodeselection import NodeFacts, PodNodes, node_refusal
from gpushare.contract.pending import HOLD_BYTES, HOLD_SECONDS, PendingBind, format_pending_binds
from gpushare.contract.request import annotations_of
from gpushare.holdings.node import node_inventory
from gpushare.holdings.pod import holds_resources
from gpushare.kube.errors import KubeConflict, KubeError
from gpushare.kube.objects import get_node, patch_node, patch_pod_annotations
from gpushare.placement import Policy
from gpushare.placement.gangplan import GangPlan, Member, Room, Spot, plan_gang
from gpushare.settings import MAX_GANG_MEMBERS

log = logging.getLogger(__name__)

#: holds older than this are written again when the plan is confirmed, so they don't expire under it
RENEW_AFTER = HOLD_SECONDS / 3

#: how many gangs' last plans are kept for their next filter
PLANS_KEPT = 256

Holds = dict[str, dict[str, PendingBind]]
#: a member's hold: the node, and its entry there
Hold = tuple[str, PendingBind]
Verdict = tuple[list[str], dict[str, str], dict[str, str]]


def active(pod: Mapping[str, Any]) -> bool:
    """A member that counts: neither finished nor being deleted."""
    meta = pod.get("metadata") or {}
    return not meta.get("deletionTimestamp") and holds_resources(pod)


class MemberPod(NamedTuple):
    """A gang member, and its ask as read from that very pod."""

    pod: Mapping[str, Any]
    ask: PodAsk

    @property
    def bound(self) -> bool:
        return bool((self.pod.get("spec") or {}).get("nodeName"))


class GangIndex:
    """The active members of every gang, by (namespace, name), from the pod watch."""

    def __init__(self, cache: ClusterCache) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, dict[str, MemberPod]] = {}
        self._gang_of: dict[str, str] = {}
        cache.add_pod_listener(self._on_pod)

    def _on_pod(self, kind: str, pod: Mapping[str, Any], ask: PodAsk) -> None:
        try:
            gang = ask.gang
        except ContractError:
            gang = None  # its own filter says what is wrong with its labels
        with self._lock:
            old = self._gang_of.pop(ask.uid, None)
            if old is not None:
                self._members.get(old, {}).pop(ask.uid, None)
                if not self._members.get(old):
                    self._members.pop(old, None)
            if kind != "DELETED" and gang is not None and active(pod):
                self._members.setdefault(gang.key, {})[ask.uid] = MemberPod(pod, ask)
                self._gang_of[ask.uid] = gang.key

    def members(self, gang: Gang) -> list[MemberPod]:
        with self._lock:
            return sorted(self._members.get(gang.key, {}).values(), key=lambda m: m.ask.key)


def _planned(ask: PodAsk) -> PodAsk | str:
    """The member's ask when the planner can read what it needs of it, else why not."""
    try:
        _ = (ask.demands, ask.rule, ask.nodes, ask.host)  # each raises when it can't be read
    except ContractError as exc:
        return str(exc)
    return ask


def _same(a: Mapping[str, PendingBind], b: Mapping[str, PendingBind]) -> bool:
    """The same members holding the same units (when they were written aside)."""
    return a.keys() == b.keys() and all(dict(a[uid].held) == dict(b[uid].held) for uid in a)


class Gangs:
    def __init__(
        self,
        api: Any,
        cache: ClusterCache,
        engine: PlacementEngine,
        binder: Binder,
        waiters: RoomWaiters,
        max_members: int = MAX_GANG_MEMBERS,
    ) -> None:
        self._api = api
        self._waiters = waiters
        self._max_members = max_members
        self._cache = cache
        self._engine = engine
        self._binder = binder
        self.index = GangIndex(cache)
        self._lock = threading.Lock()
        #: unbound member uid -> the nodes kube-scheduler offered for it at its last filter
        self._offered: dict[str, frozenset[str]] = {}
        #: gang key -> (what its last plan was made from, the policy, the plan, its problems)
        self._plans: OrderedDict[str, tuple[tuple, Policy, GangPlan, list[str]]] = OrderedDict()
        self._plan_locks = tuple(threading.Lock() for _ in range(16))
        cache.pods.add_listener(self._on_pod)

    def _on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        """A member bound or gone: forget what was kept of it while it waited."""
        if kind == "DELETED" or (pod.get("spec") or {}).get("nodeName"):
            with self._lock:
                self._offered.pop((pod.get("metadata") or {}).get("uid", ""), None)

    def _stall(self, gang: Gang, pod: Mapping[str, Any], seen: int) -> None:
        """``pod``'s gang waits for room on any node: it is marked when room may have come free."""
        meta = pod.get("metadata") or {}
        waiter = Waiter(meta.get("namespace", ""), meta.get("name", ""), ANN_GANG_RETRY, None)
        self._waiters.wait(gang.key, waiter, seen)

    def _unstall(self, gang: Gang) -> None:
        self._waiters.forget(gang.key)

    def filter(self, pod: Mapping[str, Any], ask: PodAsk, names: Sequence[str]) -> Verdict:
        """Passing nodes, failed nodes and unresolvable nodes for member ``pod`` (whose ``ask`` names its
        gang): its planned node alone once a plan for enough members is held, else none, every node with
        the reason. One gang's filters run one at a time, so a second one finds the first one's plan."""
        gang = ask.gang
        assert gang is not None
        with self._plan_locks[hash(gang.key) % len(self._plan_locks)]:
            return self._filter(MemberPod(pod, ask), gang, names)

    def _filter(self, this: MemberPod, gang: Gang, names: Sequence[str]) -> Verdict:
        pod, uid = this.pod, this.ask.uid
        seen = self._waiters.seen()
        with self._lock:
            self._offered[uid] = frozenset(names)
        members = self.index.members(gang)
        if uid not in {m.ask.uid for m in members}:
            members.append(this)  # the watch may not have brought it yet
        present = len(members)
        held = self._cache.gang_holds(gang.key)
        assumed = self._cache.assumed_uids()
        bound: list[MemberPod] = []
        waiting: list[MemberPod] = []
        for m in members:
            (bound if m.bound or m.ask.uid in assumed else waiting).append(m)
        if present > self._max_members:
            self._release(gang, held, waiting)
            reason = (
                f"gang {gang.name}: {present} members present, more than the {self._max_members} the extender "
                "plans for one gang (its --max-gang-members)"
            )
            return self._refuse(this, names, reason)
        if present < gang.minimum:
            self._unstall(gang)
            self._release(gang, held, waiting)
            missing = gang.minimum - present
            reason = f"gang {gang.name}: {present} of {gang.minimum} members present, waiting for {missing} more"
            return self._refuse(this, names, reason)
        if unoffered := self._unoffered(waiting):
            self._unstall(gang)
            self._release(gang, held, waiting)
            shown = ", ".join(unoffered[:3]) + (f" and {len(unoffered) - 3} more" if len(unoffered) > 3 else "")
            reason = (
                f"gang {gang.name}: {present} members present, {len(unoffered)} not offered any node by "
                f"kube-scheduler yet ({shown}); the gang is planned once every member has been"
            )
            return self._refuse(this, names, reason)
        plan, problems = self._held_plan(gang, uid, len(bound), waiting, held) or self._plan(
            gang, this.ask, waiting, names, held
        )
        placeable = len(bound) + len(plan.spots)
        counts = f"gang {gang.name}: {present} members present, {placeable} can be placed"
        if placeable < gang.minimum:
            self._stall(gang, pod, seen)
            self._release(gang, held, waiting)
            why = "; ".join(problems) or plan.reason
            return self._refuse(this, names, f"{counts}, {gang.minimum} needed" + (f" ({why})" if why else ""))
        spot = plan.spots.get(uid)
        if spot is None:
            return self._refuse(this, names, f"{counts}, but not this one ({plan.reason or 'no room left'})")
        failure = self._hold(gang, plan, {m.ask.uid: m.ask.key for m in waiting}, held)
        if failure is not None:
            reason = f"gang {gang.name}: holding the plan's cards failed, will try again ({failure})"
            return self._refuse(this, names, reason, resolvable=True)
        self._unstall(gang)
        self._mark(gang, [m for m in waiting if m.ask.uid != uid], {u: s.node for u, s in plan.spots.items()})
        where = f"gang {gang.name}: this member's cards are held on node {spot.node}"
        cards = ", ".join(f"{uuid} ({units})" for uuid, units in sorted(spot.held.items()))
        log.info(
            "filter pod %s: gang %s holds node %s for it, cards %s; %d of %d members placeable",
            this.ask.key, gang.key, spot.node, cards, placeable, present,
        )  # fmt: skip
        return [spot.node], {n: where for n in names if n != spot.node}, {}

    def _unoffered(self, waiting: Sequence[MemberPod]) -> list[str]:
        """The unbound members kube-scheduler has offered no node yet (by pod key): it calls the filter only
        with the nodes that passed its own filters, so a member it never calls the filter for (say, one
        asking for a resource no node has) may be unplaceable for reasons the extender can't see, and
        the gang, all or nothing, is not planned without it."""
        with self._lock:
            return sorted(m.ask.key for m in waiting if not self._offered.get(m.ask.uid))

    def _refuse(self, this: MemberPod, names: Sequence[str], reason: str, resolvable: bool = False) -> Verdict:
        """No node. The reason goes in ``FailedNodes``, the only map kube-scheduler 1.20 reads, and unless
        said otherwise also in ``FailedAndUnresolvableNodes``, which later versions read first and which
        keeps them from preempting pods for one member: that can't place a gang."""
        log.info("filter pod %s: %s", this.ask.key, reason)
        every = dict.fromkeys(names, reason)
        return [], every, {} if resolvable else dict(every)

    def _held_plan(
        self, gang: Gang, uid: str, bound: int, waiting: Sequence[MemberPod], held: Mapping[str, Hold]
    ) -> tuple[GangPlan, list[str]] | None:
        """The gang's holds as its plan, without planning, when this member holds cards on a node offered
        for it and, with the ``bound`` members, enough of the others hold cards on nodes they may still go
        to (holds that don't are left out, and so released); else None."""
        spots = {}
        for member in waiting:
            hold = held.get(member.ask.uid)
            if hold is not None and self._may_use(member.ask, hold):
                spots[member.ask.uid] = Spot(hold[0], hold[1].held)
        if uid not in spots or bound + len(spots) < gang.minimum:
            return None
        return GangPlan(spots), []

    def _may_use(self, member: PodAsk, hold: Hold) -> bool:
        """Whether the member may still go to the node it holds cards on: offered for it at its last
        filter, allowed by its constraints, and its held cards healthy there."""
        node, entry = hold
        parsed, view = _planned(member), self._cache.view(node)
        with self._lock:
            offered = self._offered.get(member.uid)
        if isinstance(parsed, str) or view is None or offered is None or node not in offered:
            return False
        healthy = {c.uuid for c in view.cards if c.healthy}
        return node_refusal(parsed.nodes, view.facts) is None and set(entry.held) <= healthy

    def _plan(
        self,
        gang: Gang,
        ask: PodAsk,
        waiting: Sequence[MemberPod],
        names: Sequence[str],
        held: Mapping[str, Hold],
    ) -> tuple[GangPlan, list[str]]:
        """The plan for the unbound members, with the problems of members that can't take part at all;
        the gang's last plan again while nothing it was made from has changed.

        Each member may go where its nodeSelector, node affinity and tolerations let it, and only to
        the nodes kube-scheduler offered for it at its last filter (``names`` for ``ask``'s); a member
        not filtered yet, nowhere (:meth:`_unoffered` keeps such a gang from being planned). A hold on a
        node the member may not go to is not kept: the member is planned afresh."""
        _, policy = self._engine.policy_for(ask)
        with self._lock:
            offered = {m.ask.uid: self._offered[m.ask.uid] for m in waiting if m.ask.uid in self._offered}
        candidates = set(names) | {node for node, _ in held.values()}
        candidates.update(*offered.values())
        views = {name: self._cache.view(name) for name in sorted(candidates)}
        key = (
            tuple(
                ((m.pod.get("metadata") or {}).get("uid"), (m.pod.get("metadata") or {}).get("resourceVersion"))
                for m in waiting
            ),
            tuple(offered.get(m.ask.uid) for m in waiting),
            frozenset(names),
            tuple((name, view.generation if view is not None else -1) for name, view in views.items()),
            tuple(sorted((uid, node, entry.at) for uid, (node, entry) in held.items())),
        )
        with self._lock:
            memo = self._plans.get(gang.key)
        if memo is not None and memo[0] == key and memo[1] is policy:
            return memo[2], memo[3]
        plan, problems = self._plan_afresh(policy, waiting, names, held, offered, views)
        with self._lock:
            self._plans[gang.key] = (key, policy, plan, problems)
            self._plans.move_to_end(gang.key)
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        return plan, problems

    def _plan_afresh(
        self,
        policy: Policy,
        waiting: Sequence[MemberPod],
        names: Sequence[str],
        held: Mapping[str, Hold],
        offered: Mapping[str, frozenset[str]],
        views: Mapping[str, NodeView | None],
    ) -> tuple[GangPlan, list[str]]:
        rooms = []
        for name, view in views.items():
            if view is None:
                continue
            ours: dict[str, int] = {}
            for node, hold in held.values():
                if node == name:
                    for uuid, units in hold.held.items():
                        ours[uuid] = ours.get(uuid, 0) + units
            cards = tuple(replace(c, used=max(c.used - ours[c.uuid], 0)) if c.uuid in ours else c for c in view.cards)
            pods = view.pod_room + sum(1 for node, _ in held.values() if node == name)
            rooms.append(Room(name, cards, view.host_free, view.inventory.unit.name, pods))
        facts = [view.facts for view in views.values() if view is not None]
        allowed_for: dict[PodNodes, tuple[frozenset[str], str]] = {}
        members, problems = [], []
        for member in waiting:
            parsed = _planned(member.ask)
            if isinstance(parsed, str):
                problems.append(parsed)
                continue
            if parsed.nodes not in allowed_for:
                allowed_for[parsed.nodes] = _allowed(parsed.nodes, facts)
            eligible, refusal = allowed_for[parsed.nodes]
            allowed = eligible & offered.get(parsed.uid, frozenset())
            if not allowed:
                why = refusal if not eligible else "kube-scheduler offered it none of the nodes it may go to"
                problems.append(f"pod {parsed.key} may go to none of {len(rooms)} node(s): {why}")
                continue
            members.append(Member(parsed.uid, parsed.key, parsed.demands, parsed.host, allowed, parsed.rule))
        previous = {uid: Spot(node, hold.held) for uid, (node, hold) in held.items()}
        return plan_gang(members, rooms, policy, previous), problems

    def _hold(self, gang: Gang, plan: GangPlan, keys: Mapping[str, str], held: Mapping[str, Hold]) -> str | None:
        """Write the plan's holds node by node (and drop the gang's holds it no longer needs); on the first
        node that refuses, put back what was there on the nodes already written. None when all is held."""
        now = time.time()
        want: Holds = {}
        for uid, spot in plan.spots.items():
            want.setdefault(spot.node, {})[uid] = PendingBind(keys[uid], dict(spot.held), now, gang.key)
        return self._write(gang, want, _by_node(held))

    def _release(self, gang: Gang, held: Mapping[str, Hold], unbound: Sequence[MemberPod]) -> None:
        if held:
            failure = self._write(gang, {}, _by_node(held))
            log.info("gang %s: holds released%s", gang.key, f" in part ({failure})" if failure else "")
        self._mark(gang, unbound, {})

    def _mark(self, gang: Gang, unbound: Sequence[MemberPod], nodes: Mapping[str, str]) -> None:
        """Set ``gpushare.io/gang-hold`` on each unbound member to the node in ``nodes`` holding its cards
        (removed when it has none) where it says otherwise: the change makes kube-scheduler retry it now.
        A member that can't be patched (gone meanwhile) is retried on kube-scheduler's own timing."""
        for member, ask in unbound:
            node = nodes.get(ask.uid)
            if annotations_of(member).get(ANN_GANG_HOLD) == node:
                continue
            meta = member.get("metadata") or {}
            try:
                patch_pod_annotations(self._api, meta.get("namespace", ""), meta.get("name", ""), {ANN_GANG_HOLD: node})
            except KubeError as exc:
                log.warning("gang %s: pod %s: marking its hold failed: %s", gang.key, ask.key, exc)
                continue
            held_on = f"cards held for it on node {node}, marked for a retry" if node else "no cards held, mark removed"
            log.info("gang %s: pod %s: %s", gang.key, ask.key, held_on)

    def _write(self, gang: Gang, want: Holds, have: Holds) -> str | None:
        written: list[str] = []
        for node in sorted(set(want) | set(have)):
            wanted, had = want.get(node, {}), have.get(node, {})
            if _same(wanted, had) and all(time.time() - h.at < RENEW_AFTER for h in had.values()):
                continue
            failure = self._write_node(gang, node, wanted, had)
            if failure is not None:
                for done in written:
                    self._write_node(gang, done, have.get(done, {}), want.get(done, {}))
                return failure
            written.append(node)
        return None

    def _write_node(self, gang: Gang, node: str, entries: Holds, expected: Holds) -> str | None:
        """Replace the gang's holds on ``node`` (which must be ``expected``) with ``entries``, by
        compare-and-swap against fresh reads, checking that the cards they hold are free."""
        entries_, expected_ = dict(entries), dict(expected)
        with self._binder.node_lock(node):
            for _ in range(ATTEMPTS):
                try:
                    node_obj = get_node(self._api, node)
                    inventory = node_inventory(node_obj)
                    # the members held here are unbound, so leaving them out leaves out no pod on the node
                    own = set(expected_) | set(entries_)
                    pending, cards, bound = self._binder.fresh_cards(node_obj, inventory, own)
                    # a member bound meanwhile (a replica whose pod cache lags sees it unbound) keeps its entry
                    bound = {uid for uid in entries_ if uid in bound or (uid in pending and not pending[uid].gang)}
                    if bound:
                        keys = ", ".join(sorted(entries_[uid].pod for uid in bound))
                        return f"node {node}: member(s) {keys} were bound meanwhile"
                    ours = {uid: e for uid, e in pending.items() if e.gang == gang.key}
                    if not _same(ours, expected_):
                        return f"node {node}: the gang's holds there changed meanwhile"
                    short = _shortfall(cards, entries_)
                    if short:
                        return f"node {node}: {short}"
                    rest = {uid: e for uid, e in pending.items() if e.gang != gang.key}
                    text = format_pending_binds(rest | entries_)
                    if entries_ and len(text) > HOLD_BYTES:
                        return (
                            f"node {node}: with {len(entries_)} hold(s) of the gang its annotation "
                            f"{NODE_ANN_PENDING_BINDS} would take {len(text)} bytes, more than the {HOLD_BYTES} "
                            "gang holds may fill"
                        )
                    written = patch_node(
                        self._api,
                        node,
                        {"metadata": {"annotations": {NODE_ANN_PENDING_BINDS: text}}},
                        resource_version=(node_obj.get("metadata") or {}).get("resourceVersion"),
                    )
                except KubeConflict:
                    continue
                except (KubeError, ContractError) as exc:
                    return f"node {node}: {exc}"
                self._cache.note_node(written)
                log.info("gang %s: node %s holds cards for %d member(s)", gang.key, node, len(entries_))
                return None
        return f"node {node} kept changing under {ATTEMPTS} attempts"


def _shortfall(cards: Sequence[placement.CardCapacity], entries: Mapping[str, PendingBind]) -> str | None:
    """Why the cards can't give ``entries`` what they hold, or None."""
    need: dict[str, int] = {}
    for entry in entries.values():
        for uuid, units in entry.held.items():
            need[uuid] = need.get(uuid, 0) + units
    by_uuid = {c.uuid: c for c in cards}
    for uuid, units in sorted(need.items()):
        card = by_uuid.get(uuid)
        if card is None or card.free < units:
            free = 0 if card is None else card.free
            return f"card {uuid} has {free} units free, the plan holds {units} there"
    return None


def _allowed(nodes: PodNodes, facts: Sequence[NodeFacts]) -> tuple[frozenset[str], str]:
    """The nodes a member with ``nodes`` may go to, and the first refusal (when it may go nowhere)."""
    refusals = {f.name: node_refusal(nodes, f) for f in facts}
    first = next((r for r in refusals.values() if r), "no node is known")
    return frozenset(name for name, refusal in refusals.items() if refusal is None), first


def _by_node(held: Mapping[str, Hold]) -> Holds:
    nodes: Holds = {}
    for uid, (node, hold) in held.items():
        nodes.setdefault(node, {})[uid] = hold
    return nodes
