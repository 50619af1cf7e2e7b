"""The cards and pods the tests of tests/crishim give the CRI shim: node-a holds two
A100-80GB and a T4."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from podfactory import container, gpu_pod

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.names import (
    ANN_ALLOCATION,
)
from gpushare.contract.pending import Ledger
from gpushare.contract.units import GIB
from gpushare.enforcement.container import Target
from gpushare.gpus.simulated import simulated_cards
from gpushare.kube.errors import KubeNotFound, KubeUnavailable

NODE = "node-a"
CARDS = simulated_cards(NODE, "2xA100-80GB:81920,1xT4:15360")
A0, A1, T4 = CARDS
UNITS = {c.uuid: GIB.units_of(c.memory_mib) for c in CARDS}
POD = Target(namespace="default", pod="train", uid="uid-train", container="worker")


def slice_of(card: Any, units: int = 20) -> CardSlice:
    return CardSlice(index=card.index, uuid=card.uuid, units=units)


def allocation_of(**containers: tuple[CardSlice, ...]) -> dict[str, str]:
    return {ANN_ALLOCATION: format_allocation(containers)}


class FakePods:
    """The pods the shim asks the API about, the node's ledger and the ResourceClaims (by name)."""

    node = NODE

    def __init__(
        self,
        pods: list[dict[str, Any]],
        fail: bool = False,
        synced: bool = True,
        claims: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.pods = pods
        self.fail = fail
        self.synced = synced
        self.asked: list[tuple[str, str]] = []
        #: the node's ledger
        self.recorded: Ledger = {}
        self.claims = {c["metadata"]["name"]: c for c in claims}
        #: the ResourceClaims read, by name, in order
        self.claims_asked: list[str] = []

    def resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.claims_asked.append(name)
        if self.fail:
            raise KubeUnavailable(f"ResourceClaim {namespace}/{name}: API server unreachable")
        if name not in self.claims:
            raise KubeNotFound(f"ResourceClaim {namespace}/{name}: not found")
        return self.claims[name]

    def pod(self, namespace: str, name: str, uid: str) -> Mapping[str, Any] | None:
        self.asked.append((namespace, name))
        if self.fail:
            raise KubeUnavailable(f"pod {namespace}/{name}: API server unreachable")
        return next((p for p in self.pods if p["metadata"]["name"] == name and p["metadata"]["uid"] == uid), None)

    def node_pods(self) -> Sequence[Mapping[str, Any]] | None:
        return self.pods if self.synced else None

    def ledger(self) -> Ledger:
        return self.recorded


def pod_dict(name: str, uid: str, allocation: dict[str, tuple[CardSlice, ...]] | None, mem: int = 20) -> dict[str, Any]:
    """A running pod on node-a: a worker asking for ``mem`` units and a sidecar asking for none."""
    return gpu_pod(
        name,
        [container("worker", mem), {"name": "sidecar"}],
        node="node-a",
        uid=uid,
        phase="Running",
        extra_annotations=allocation_of(**allocation) if allocation else None,
    )
