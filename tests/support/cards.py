"""What a running GPU pod must see: exactly the cards the scheduler wrote for each of its containers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpushare.contract.env import assigned_env, toolkit_memory_env
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.request import parse_pod_request
from gpushare.holdings.pod import pod_allocation


def assert_sees_assigned_cards(
    pod: Mapping[str, Any], inventory: NodeInventory, env_of: Callable[[str], Mapping[str, str]]
) -> None:
    """Every GPU container of ``pod`` (on the node of ``inventory``) sees exactly the cards the scheduler
    wrote for it, with the matching ALIYUN_COM_GPU_MEM_* values; ``env_of(container)`` is the
    environment the container's process really has."""
    name = pod["metadata"]["name"]
    allocation = pod_allocation(pod, inventory.cards)
    assert allocation, f"pod {name} carries no card assignment"
    units = {card.uuid: inventory.units_of(card) for card in inventory.cards}
    pod_mem = parse_pod_request(pod).effective_mem
    for container, slices in allocation.items():
        env = env_of(container)
        expected = assigned_env(slices, pod_mem, units) | toolkit_memory_env(slices, inventory.unit.mib)
        seen = {k: env.get(k) for k in expected}
        assert seen == expected, f"pod {name} container {container}: env {seen} != assigned {expected}"
