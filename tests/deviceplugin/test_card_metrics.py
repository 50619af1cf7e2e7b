"""The device plugin's per-card gauges follow the cards it is given."""

from dataclasses import replace

from gpushare.deviceplugin.metrics import publish_card_usage
from prometheus_client import REGISTRY

from gpushare.cards import ENFORCED
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards


def enforced(card_index: int, uuid: str, model: str) -> float | None:
    labels = {"node": "limits-node", "card": str(card_index), "uuid": uuid, "model": model}
    return REGISTRY.get_sample_value("gpushare_memory_limits_enforced", labels)


def test_the_memory_limits_gauge_is_1_on_enforcing_cards_and_0_on_the_others() -> None:
    a100, t4 = simulated_cards("limits-node", "1xA100-80GB:81920,1xT4:15360")
    a100 = replace(a100, memory_limits=ENFORCED)
    publish_card_usage("limits-node", [a100, t4], {}, GIB)
    assert enforced(0, a100.uuid, a100.model) == 1.0
    assert enforced(1, t4.uuid, t4.model) == 0.0
    # a card whose limits stop being enforced (the node moved to a driver without them) reads 0
    publish_card_usage("limits-node", [replace(a100, memory_limits="cgroup hybrid"), t4], {}, GIB)
    assert enforced(0, a100.uuid, a100.model) == 0.0
