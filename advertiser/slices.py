"""Keeps the node's ResourceSlice of the DRA driver ``gpu.gpushare.io`` in place: written when the cards
change (with the next pool generation), written again when it is deleted (kubelet deletes its node's
slices when it starts), and, with ``--dra-order best-fit``, written again when what the allocated
ResourceClaims hold changes the order first fit should meet the cards in
(:mod:`gpushare.advertiser.deviceorder`). Thin I/O around :mod:`gpushare.advertiser.resourceslice`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpushare.advertiser.agent import Advertiser
from gpushare.advertiser.deviceorder import ORDER_BEST_FIT, ORDER_INDEX, best_fit_order
from gpushare.advertiser.resourceslice import card_rooms, device_changes, resource_slice, slice_current
from kubernetes import client

from gpushare.cards import Card
from gpushare.contract.errors import ContractError
from gpushare.contract.names import dra_slice_name
from gpushare.contract.resourceclaim import claim_shares
from gpushare.contract.resourceslice import ResourceSliceError, live_generation, offered_cards
from gpushare.kube.errors import KubeNotFound
from gpushare.kube.transport import call
from gpushare.kube.watch import WatchCache

log = logging.getLogger(__name__)


class NodeClaims:
    """What allocated ResourceClaims consume of ``node``'s cards (NVML index -> bytes), from a watch of
    every claim (a claim says its node only in its allocation, which no field selector reaches);
    ``changed`` is called when that changes, and only then, so claims of other nodes wake nobody."""

    def __init__(self, api: Any, node: str, changed: Callable[[], None]) -> None:
        self.node, self.changed = node, changed
        self.watch = WatchCache(api, "resourceclaims")
        self._lock = threading.Lock()
        #: claim (namespace, name) -> what it holds of this node's cards
        self._held: dict[tuple[str, str], dict[int, int]] = {}
        self.watch.add_listener(self._on_claim)

    def _on_claim(self, kind: str, claim: Mapping[str, Any]) -> None:
        meta = claim.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        held: dict[int, int] = {}
        if kind != "DELETED":
            try:
                shares = claim_shares(claim)
            except ContractError as exc:
                log.warning("node %s: %s; what it holds does not order the ResourceSlice", self.node, exc)
                shares = []
            for share in (s for s in shares if s.node == self.node):
                held[share.index] = held.get(share.index, 0) + share.memory_bytes
        with self._lock:
            before = self._held.pop(key, {})
            if held:
                self._held[key] = held
        if held != before:
            self.changed()

    def used(self) -> dict[int, int] | None:
        """Bytes allocated per card, or None until every claim has been listed."""
        if not self.watch.synced:
            return None
        used: dict[int, int] = {}
        with self._lock:
            for held in self._held.values():
                for index, memory in held.items():
                    used[index] = used.get(index, 0) + memory
        return used


def _live_order(live: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The NVML indexes in the order the live slice lists them (() when there is none to read)."""
    try:
        return tuple(c.index for c in offered_cards(live)) if live else ()
    except ResourceSliceError:
        return ()


def _names(obj: Mapping[str, Any] | None) -> list[str]:
    return [d.get("name") for d in ((obj or {}).get("spec") or {}).get("devices") or []]


@dataclass(eq=False)
class SlicePublisher(Advertiser):
    """Keeps ``node``'s ResourceSlice true to ``backend``'s healthy cards, in ``unit``; re-checks every
    ``interval`` seconds, at once on a health event, and at once when the slice changes or goes. With
    ``order`` best-fit the devices are listed least free first, and re-checked at once when what the
    claims allocated on the node changes; claim changes that come while a write is under way are
    folded into one more check, and a check writes only when the order (or anything else) changed."""

    order: str = ORDER_INDEX
    what = "the ResourceSlice"
    thread_name = "resourceslice"
    _generation: int = field(default=0, init=False, repr=False)
    _watch: WatchCache | None = field(default=None, init=False, repr=False)
    _claims: NodeClaims | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        resource_slice(self.node, [], self.unit, 0)  # a node name or unit no slice can carry fails here, not later
        super().__post_init__()

    @property
    def name(self) -> str:
        return dra_slice_name(self.node)

    def _read(self) -> dict[str, Any] | None:
        try:
            return call(f"ResourceSlice {self.name}", client.ResourceV1Api(self.api).read_resource_slice, self.name)
        except KubeNotFound:
            return None

    def _order(self, live: Mapping[str, Any] | None, cards: Sequence[Card]) -> Sequence[int]:
        """The NVML indexes in the order to publish: () for index order; the live slice's order while
        the claims are not listed yet (so that a restart writes nothing until it knows better)."""
        if self._claims is None:
            return ()
        used = self._claims.used()
        if used is None:
            return _live_order(live)
        return best_fit_order(card_rooms(cards, self.unit, used))

    def publish_once(self) -> bool:
        """Bring the slice up to date. Returns whether it was written."""
        live = self._read()
        self._generation = max(self._generation, live_generation(live) if live else 0)
        cards = self.backend.cards()
        desired = resource_slice(self.node, cards, self.unit, self._generation, self._order(live, cards))
        if live is not None and slice_current(live, desired):
            self.published.set()
            return False
        desired["spec"]["pool"]["generation"] = self._generation = self._generation + 1
        resource = client.ResourceV1Api(self.api)
        if live is None:
            call(f"ResourceSlice {self.name}", resource.create_resource_slice, desired)
            log.info("node %s: created ResourceSlice %s (generation %d)", self.node, self.name, self._generation)
        else:
            desired["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
            call(f"ResourceSlice {self.name}", resource.replace_resource_slice, self.name, desired)
        changes = device_changes(live, desired)
        if live is not None and not changes:
            reordered = self._claims is not None and _names(live) != _names(desired)
            listing = f"lists its devices least free first: {', '.join(_names(desired))}"
            changes = [listing if reordered else "was rewritten (its spec had been changed)"]
        for change in changes:
            log.info("node %s: ResourceSlice %s %s (generation %d)", self.node, self.name, change, self._generation)
        self.published.set()
        return True

    def start(self) -> None:
        self._watch = WatchCache(self.api, "resourceslices", field_selector=f"metadata.name={self.name}")
        self._watch.add_listener(lambda _type, _obj: self._wake.set())
        self._watch.start()
        if self.order == ORDER_BEST_FIT:
            self._claims = NodeClaims(self.api, self.node, self._wake.set)
            self._claims.watch.start()
        super().start()

    def stop(self) -> None:
        for watch in (self._watch, self._claims and self._claims.watch):
            if watch is not None:
                watch.stop()
        super().stop()
