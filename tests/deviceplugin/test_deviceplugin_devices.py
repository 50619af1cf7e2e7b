"""What the plugin lists to kubelet, and the guard that keeps the gpu-mem list within one gRPC message."""

from __future__ import annotations

import re

import pytest
from gpushare.deviceplugin.devices import (
    HEALTHY,
    MAX_MESSAGE_BYTES,
    UNHEALTHY,
    DeviceListTooLarge,
    card_of_device,
    check_message_size,
    device_list,
    message_size,
)

from gpushare.cards import Card
from gpushare.cli import build_parser
from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM, RESOURCES
from gpushare.contract.units import GIB, MemoryUnit, parse_unit
from gpushare.gpus.simulated import simulated_cards
from gpushare.settings import UsageError, device_plugin_settings

MIXED = simulated_cards("n1", "2xA100-80GB:81920,1xT4:15360")
H200 = simulated_cards("n1", "8xH200:144384")


def test_gpu_mem_lists_one_device_per_unit_of_each_cards_own_memory() -> None:
    devices = device_list(RESOURCE_MEM, MIXED, GIB).devices
    per_card: dict[str, int] = {}
    for d in devices:
        per_card[card_of_device(d.ID)] = per_card.get(card_of_device(d.ID), 0) + 1
    assert per_card == {MIXED[0].uuid: 80, MIXED[1].uuid: 80, MIXED[2].uuid: 15}
    assert len({d.ID for d in devices}) == len(devices)
    assert {d.health for d in devices} == {HEALTHY}


def test_gpu_mem_in_blocks_counts_whole_blocks_only() -> None:
    devices = device_list(RESOURCE_MEM, MIXED, parse_unit("4096MiB")).devices
    assert len(devices) == 20 + 20 + 3  # 15360 MiB holds three whole 4 GiB blocks


def test_gpu_count_lists_one_replica_per_memory_unit_of_each_card_with_its_numa_node() -> None:
    devices = device_list(RESOURCE_COUNT, MIXED, GIB).devices
    numa = {card.uuid: card.numa_node for card in MIXED}
    per_card: dict[str, int] = {}
    for d in devices:
        owner = card_of_device(d.ID)
        per_card[owner] = per_card.get(owner, 0) + 1
        assert [n.ID for n in d.topology.nodes] == [numa[owner]]
    # a card can't hold more gpu-count containers than it has units: the replicas never run out first
    assert per_card == {MIXED[0].uuid: 80, MIXED[1].uuid: 80, MIXED[2].uuid: 15}
    assert len({d.ID for d in devices}) == len(devices)


def test_gpu_count_replicas_per_card_can_be_set() -> None:
    devices = device_list(RESOURCE_COUNT, MIXED, GIB, replicas=4).devices
    assert [d.ID for d in devices] == [f"{card.uuid}-_-{n}" for card in MIXED for n in range(4)]
    assert len(device_list(RESOURCE_MEM, MIXED, GIB, replicas=4).devices) == 175  # gpu-mem unaffected


def test_a_card_without_numa_information_carries_no_topology() -> None:
    card = Card(0, "GPU-11111111-2222-3333-4444-555555555555", "X", 1024, 0, numa_node=None)
    (device,) = device_list(RESOURCE_COUNT, [card], GIB).devices
    assert not device.HasField("topology")


def test_too_many_gpu_count_replicas_are_refused_naming_the_flag() -> None:
    with pytest.raises(DeviceListTooLarge, match=r"gpu-count with 100000 replicas per card .* --count-replicas"):
        check_message_size(H200, GIB, replicas=100_000)


@pytest.mark.parametrize("resource", RESOURCES)
def test_an_unhealthy_card_is_unhealthy_in_every_device_of_both_resources(resource: str) -> None:
    sick = MIXED[2].uuid
    cards = [card.with_health(card.uuid != sick) for card in MIXED]
    for d in device_list(resource, cards, GIB).devices:
        owner = card_of_device(d.ID)
        assert d.health == (UNHEALTHY if owner == sick else HEALTHY)


@pytest.mark.parametrize(("cards", "unit"), [(MIXED, "GiB"), (MIXED, "MiB"), (H200, "GiB"), (H200, "256MiB")])
def test_message_size_is_the_size_of_the_real_message(cards: list[Card], unit: str) -> None:
    memory_unit = parse_unit(unit)
    assert message_size(cards, memory_unit) == device_list(RESOURCE_MEM, cards, memory_unit).ByteSize()


@pytest.mark.parametrize("unit", ["GiB", "256MiB", "32MiB"])
def test_coarse_units_pass_the_guard_for_eight_large_cards(unit: str) -> None:
    check_message_size(H200, parse_unit(unit))


def test_per_mib_devices_are_refused_naming_the_finest_unit_that_fits() -> None:
    with pytest.raises(DeviceListTooLarge) as refused:
        check_message_size(H200, parse_unit("MiB"))
    message = str(refused.value)
    assert "units of MiB" in message and "4,194,304-byte" in message
    suggested = parse_unit(re.search(r"--memory-unit (\S+)", message).group(1))
    unhealthy = [card.with_health(False) for card in H200]
    assert message_size(unhealthy, suggested) <= MAX_MESSAGE_BYTES
    assert message_size(unhealthy, MemoryUnit(suggested.mib // 2)) > MAX_MESSAGE_BYTES


def test_guard_leaves_room_for_every_card_turning_unhealthy() -> None:
    def card(mib: int) -> Card:
        return Card(0, "GPU-11111111-2222-3333-4444-555555555555", "X", mib, 0, numa_node=0)

    # the largest card whose healthy per-MiB list still fits: once it is unhealthy, it no longer does
    low, high = 1, 200_000
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if message_size([card(mid)], MemoryUnit(1)) <= MAX_MESSAGE_BYTES else (low, mid - 1)
    assert message_size([card(low).with_health(False)], MemoryUnit(1)) > MAX_MESSAGE_BYTES
    with pytest.raises(DeviceListTooLarge):
        check_message_size([card(low)], MemoryUnit(1))


def test_device_plugin_flags_for_replicas_and_rereads_reach_the_settings_and_negatives_are_refused() -> None:
    parser = build_parser()
    base = ["device-plugin", "--node-name", "n1", "--count-replicas", "8", "--allocate-rereads", "2"]
    settings = device_plugin_settings(parser.parse_args(base))
    assert settings.count_replicas == 8
    assert settings.reread.waits() == [0.0, 0.1]
    for flag in ("--count-replicas", "--allocate-rereads", "--allocate-reread-wait"):
        with pytest.raises(UsageError, match="must not be negative"):
            device_plugin_settings(parser.parse_args([*base, flag, "-1"]))
