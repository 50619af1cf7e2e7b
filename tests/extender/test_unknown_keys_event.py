"""The extender records one warning Event on a pod that carries keys gpushare ignores, naming each key
and the key it most likely meant."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpushare.extender import verbs
from gpushare.extender.cache import ClusterCache
from gpushare.extender.engine import PlacementEngine
from podfactory import container, gpu_pod

from gpushare.cards import Card
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY
from gpushare.contract.units import GIB


class Recorded:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str]] = []

    def record(self, obj: Mapping[str, Any], *, reason: str, message: str, type_: str = "Normal") -> None:
        self.events.append((obj["metadata"]["name"], type_, reason, message))


def engine() -> PlacementEngine:
    cache = ClusterCache(None)
    cards = [Card(0, "GPU-0", "A100-SXM4-80GB", 81920, minor=0)]
    cache.nodes.apply({"metadata": {"name": "n1", "resourceVersion": "1", "annotations": {
        NODE_ANN_INVENTORY: format_inventory(cards, GIB)}}})  # fmt: skip
    return PlacementEngine(cache, "binpack")


def filtered(annotations: dict[str, str]) -> list[tuple[str, str, str, str]]:
    pod = gpu_pod("typo", [container("main", 4)], node=None, extra_annotations=annotations)
    events = Recorded()
    verbs.filter_result(engine(), {"Pod": pod, "NodeNames": ["n1"]}, events=events)  # type: ignore[arg-type]
    return events.events


def test_a_pod_with_a_typo_gets_one_warning_event_naming_the_key_it_meant() -> None:
    assert filtered({"gpushare.io/gpu-modle": "A10", "gpushare.io/polcy": "spread"}) == [
        (
            "typo",
            "Warning",
            verbs.UNKNOWN_KEYS_EVENT,
            "gpushare ignores annotation 'gpushare.io/gpu-modle': did you mean 'gpushare.io/gpu-model'?; "
            "gpushare ignores annotation 'gpushare.io/polcy': did you mean 'gpushare.io/policy'?",
        )
    ]


def test_a_pod_without_one_gets_none() -> None:
    assert filtered({"gpushare.io/gpu-model": "A100"}) == []
