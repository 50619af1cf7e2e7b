"""Keeps the node's ResourceSlice of the DRA driver ``gpu.gpushare.io`` in place: written when the cards
change (with the next pool generation), written again when it is deleted (kubelet deletes its node's
slices when it starts). Thin I/O around :mod:`gpushare.advertiser.resourceslice`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from gpushare.advertiser.agent import Advertiser
from gpushare.advertiser.resourceslice import device_changes, live_generation, resource_slice, slice_current
from kubernetes import client

from gpushare.contract.names import dra_slice_name
from gpushare.kube.errors import KubeNotFound
from gpushare.kube.transport import call
from gpushare.kube.watch import WatchCache

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SlicePublisher(Advertiser):
    """Keeps ``node``'s ResourceSlice true to ``backend``'s healthy cards, in ``unit``; re-checks every
    ``interval`` seconds, at once on a health event, and at once when the slice changes or goes."""

    what = "the ResourceSlice"
    thread_name = "resourceslice"
    _generation: int = field(default=0, init=False, repr=False)
    _watch: WatchCache | None = field(default=None, init=False, repr=False)

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

    def publish_once(self) -> bool:
        """Bring the slice up to date. Returns whether it was written."""
        live = self._read()
        self._generation = max(self._generation, live_generation(live) if live else 0)
        desired = resource_slice(self.node, self.backend.cards(), self.unit, self._generation)
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
        rewritten = [] if live is None else ["was rewritten (its spec had been changed)"]
        for change in device_changes(live, desired) or rewritten:
            log.info("node %s: ResourceSlice %s %s (generation %d)", self.node, self.name, change, self._generation)
        self.published.set()
        return True

    def start(self) -> None:
        self._watch = WatchCache(self.api, "resourceslices", field_selector=f"metadata.name={self.name}")
        self._watch.add_listener(lambda _type, _obj: self._wake.set())
        self._watch.start()
        super().start()

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        super().stop()
