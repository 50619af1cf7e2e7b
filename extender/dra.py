"""The extender's view of the DRA driver ``gpu.gpushare.io``, from two watches: the cards each node's
ResourceSlice offers, what allocated ResourceClaims consume of them, and the requests of the claims a
pod waits on. Thin: the slices and claims are read by the readers ``inspect`` uses
(:func:`~gpushare.contract.resourceslice.offered_by_pool`, :func:`~gpushare.contract.resourceclaim.claim_shares`),
the choice is :mod:`gpushare.placement.dra`'s."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from gpushare.contract.errors import ContractError
from gpushare.contract.names import DRA_DRIVER
from gpushare.contract.request import pod_key
from gpushare.contract.resourceclaim import ClaimError, ClaimShare, asks_driver, claim_shares, driver_requests
from gpushare.contract.resourceslice import live_pool, offered_by_pool
from gpushare.holdings.dra import pod_claim_names
from gpushare.kube.watch import WatchCache
from gpushare.placement.dra import DeviceAsk, DraCard

log = logging.getLogger(__name__)


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


class DraView:
    """Each node's DRA cards with what allocated claims consume of them (kept up to date by the watches'
    listeners), and the requests of a pod's claims."""

    def __init__(self, api: Any) -> None:
        self.slices = WatchCache(api, "resourceslices", field_selector=f"spec.driver={DRA_DRIVER}")
        self.claims = WatchCache(api, "resourceclaims")
        self._lock = threading.Lock()
        #: pool (node) -> its slices by name
        self._slices: dict[str, dict[str, Mapping[str, Any]]] = {}
        #: pool -> its cards as DraCards without usage, read back from its slices once they changed
        self._offered: dict[str, tuple[DraCard, ...]] = {}
        #: claim (namespace, name) -> its shares; (pool, device) -> bytes all claims consume of it
        self._held: dict[tuple[str, str], list[ClaimShare]] = {}
        self._used: dict[tuple[str, str], int] = {}
        self.slices.add_listener(self._on_slice)
        self.claims.add_listener(self._on_claim)

    def start(self) -> None:
        self.slices.start()
        self.claims.start()

    def stop(self) -> None:
        self.slices.stop()
        self.claims.stop()

    @property
    def synced(self) -> bool:
        return self.slices.synced and self.claims.synced

    def _on_slice(self, kind: str, live: Mapping[str, Any]) -> None:
        pool = live_pool(live)
        with self._lock:
            held = self._slices.setdefault(pool, {})
            if kind == "DELETED":
                held.pop(_key(live)[1], None)
            else:
                held[_key(live)[1]] = live
            self._offered.pop(pool, None)

    def _on_claim(self, kind: str, claim: Mapping[str, Any]) -> None:
        key = _key(claim)
        shares: list[ClaimShare] = []
        if kind != "DELETED":
            try:
                shares = claim_shares(claim)
            except ContractError as exc:
                log.warning("%s; what it holds is not counted", exc)
        with self._lock:
            for share in self._held.pop(key, []):
                self._used[(share.node, share.device)] -= share.memory_bytes
            for share in shares:
                device = (share.node, share.device)
                self._used[device] = self._used.get(device, 0) + share.memory_bytes
            if shares:
                self._held[key] = shares

    def cards(self, node: str) -> tuple[DraCard, ...]:
        """The node's DRA cards in slice order, with the bytes allocated claims consume of each."""
        with self._lock:
            offered = self._offered.get(node)
            if offered is None:
                by_pool, problems = offered_by_pool(self._slices.get(node, {}).values())
                for problem in problems:
                    log.warning("%s", problem)
                offered = tuple(
                    DraCard(c.device, c.memory_bytes, unit=c.unit_bytes or 1) for c in by_pool.get(node, ())
                )
                self._offered[node] = offered
            return tuple(DraCard(c.device, c.capacity, self._used.get((node, c.device), 0), c.unit) for c in offered)

    def requests(self, pod: Mapping[str, Any]) -> tuple[DeviceAsk, ...]:
        """What kube-scheduler will allocate of this driver's cards for the pod's claims: every request
        of each claim that asks for them, when all of the pod's claims are in the cache and those are
        not allocated yet and ask only this driver's cards by memory (see :func:`driver_requests`);
        else a ClaimError naming the pod and the claim. None asked for: ()."""
        key, namespace = pod_key(pod), (pod.get("metadata") or {}).get("namespace") or ""
        if not self.synced:
            raise ClaimError(f"pod {key}: the ResourceSlices and ResourceClaims are not listed yet")
        requests: list[DeviceAsk] = []
        for name in pod_claim_names(pod):
            claim = self.claims.get(name, namespace)
            where = f"pod {key}: ResourceClaim {namespace}/{name}"
            if claim is None:
                raise ClaimError(f"{where} is not in the cache yet")
            if not asks_driver(claim):
                continue
            if (claim.get("status") or {}).get("allocation"):
                raise ClaimError(f"{where} is allocated already")
            requests += driver_requests(claim, where)
        return tuple(requests)
