"""The node's ResourceSlice of the DRA driver: one shareable device per healthy card, in whole memory units."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gpushare.advertiser.resourceslice import device_changes, resource_slice, slice_current

from gpushare.cards import Card
from gpushare.contract.dra import DraDeviceNameError, format_device_name, parse_device_name
from gpushare.contract.resourceslice import OfferedCard, ResourceSliceError, offered_cards
from gpushare.contract.units import GIB, MemoryUnit
from gpushare.gpus.simulated import simulated_cards

SPEC = "2xA100-80GB:81920,1xT4:15360"


def devices(slice_: dict) -> dict[str, dict]:
    return {d["name"]: d for d in slice_["spec"]["devices"]}


def test_one_shareable_device_per_card_named_by_nvml_index() -> None:
    cards = simulated_cards("n1", SPEC)
    got = resource_slice("n1", cards, GIB, 3)
    assert got["apiVersion"] == "resource.k8s.io/v1" and got["kind"] == "ResourceSlice"
    assert got["metadata"]["name"] == "n1-gpu.gpushare.io"
    spec = got["spec"]
    assert spec["driver"] == "gpu.gpushare.io" and spec["nodeName"] == "n1"
    assert spec["pool"] == {"name": "n1", "generation": 3, "resourceSliceCount": 1}
    assert list(devices(got)) == ["card-0", "card-1", "card-2"]
    assert all(d["allowMultipleAllocations"] is True for d in spec["devices"])


def test_attributes_say_which_card_it_is() -> None:
    cards = simulated_cards("n1", SPEC)
    card = cards[2]
    attributes = devices(resource_slice("n1", cards, GIB, 1))["card-2"]["attributes"]
    assert attributes == {
        "uuid": {"string": card.uuid},
        "index": {"int": 2},
        "minor": {"int": card.minor},
        "model": {"string": "T4"},
        "numa": {"int": card.numa_node},
    }
    assert card.minor != card.index  # the simulated cards number them differently, so a mix-up shows


def test_numa_is_left_out_when_unknown() -> None:
    card = replace(simulated_cards("n1", "1xT4:15360")[0], numa_node=None)
    assert "numa" not in devices(resource_slice("n1", [card], GIB, 1))["card-0"]["attributes"]


def test_memory_is_the_cards_whole_units_handed_out_a_unit_at_a_time() -> None:
    card = replace(simulated_cards("n1", "1xT4:15360")[0], memory_mib=15109)  # 14 GiB and a bit
    memory = devices(resource_slice("n1", [card], GIB, 1))["card-0"]["capacity"]["memory"]
    assert memory == {
        "value": "14336Mi",
        "requestPolicy": {"default": "1024Mi", "validRange": {"min": "1024Mi", "max": "14336Mi", "step": "1024Mi"}},
    }
    in_mib = devices(resource_slice("n1", [card], MemoryUnit(1), 1))["card-0"]["capacity"]["memory"]
    assert in_mib["value"] == "15109Mi" and in_mib["requestPolicy"]["validRange"]["step"] == "1Mi"
    odd = devices(resource_slice("n1", [card], MemoryUnit(1000), 1))["card-0"]["capacity"]["memory"]
    assert odd["value"] == "15000Mi" and odd["requestPolicy"]["default"] == "1000Mi"


def test_a_card_of_one_unit_has_no_step_and_one_of_less_is_left_out() -> None:
    card = simulated_cards("n1", "1xT4:15360")[0]
    one = devices(resource_slice("n1", [replace(card, memory_mib=1500)], GIB, 1))["card-0"]
    assert one["capacity"]["memory"]["requestPolicy"]["validRange"] == {"min": "1024Mi", "max": "1024Mi"}
    assert resource_slice("n1", [replace(card, memory_mib=1000)], GIB, 1)["spec"]["devices"] == []


def test_unhealthy_cards_leave_the_slice() -> None:
    cards = simulated_cards("n1", SPEC)
    cards[1] = cards[1].with_health(False)
    assert list(devices(resource_slice("n1", cards, GIB, 1))) == ["card-0", "card-2"]


def test_nvlink_cliques_are_named_by_their_lowest_index() -> None:
    cards = simulated_cards("n1", "4xA100-80GB:81920,2xT4:15360")  # NUMA 0: A100 0-2, NUMA 1: A100 3, T4 4-5
    got = devices(resource_slice("n1", cards, GIB, 1))
    cliques = {name: d["attributes"].get("nvlinkClique") for name, d in got.items()}
    assert cliques == {
        "card-0": {"int": 0},
        "card-1": {"int": 0},
        "card-2": {"int": 0},
        "card-3": None,
        "card-4": {"int": 4},
        "card-5": {"int": 4},
    }


def test_peers_that_are_no_clique_get_no_clique_attribute() -> None:
    base = simulated_cards("n1", "3xA100-80GB:81920")
    uuids = [c.uuid for c in base]
    chain = [  # 0-1 and 1-2 linked, 0-2 not
        replace(base[0], nvlink_peers=(uuids[1],)),
        replace(base[1], nvlink_peers=(uuids[0], uuids[2])),
        replace(base[2], nvlink_peers=(uuids[1],)),
    ]
    got = devices(resource_slice("n1", chain, GIB, 1))
    assert all("nvlinkClique" not in d["attributes"] for d in got.values())


def test_an_unhealthy_peer_breaks_its_clique_no_further() -> None:
    cards = simulated_cards("n1", "3xA100-80GB:81920,1xT4:15360")  # A100 0-1 on NUMA 0 are peers
    cards[1] = cards[1].with_health(False)
    got = devices(resource_slice("n1", cards, GIB, 1))
    assert "nvlinkClique" not in got["card-0"]["attributes"]


@pytest.mark.parametrize(
    ("node", "cards", "unit", "generation", "message"),
    [
        ("", [], GIB, 1, "node name is empty"),
        ("n" * 240, [], GIB, 1, "too long"),
        ("n1", [], GIB, -1, "generation -1 is negative"),
        ("n1", [], MemoryUnit(0), 1, "not positive"),
        ("n1", [Card(0, "GPU-a", "T4", 15360, 0), Card(0, "GPU-b", "T4", 15360, 1)], GIB, 1, "share NVML index 0"),
        ("n1", [Card(0, "GPU-a", "", 15360, 0)], GIB, 1, "card 0: model ''"),
        ("n1", [Card(0, "GPU-" + "a" * 61, "T4", 15360, 0)], GIB, 1, "card 0: uuid"),
    ],
)
def test_bad_input_is_refused_naming_the_node_and_card(
    node: str, cards: list[Card], unit: MemoryUnit, generation: int, message: str
) -> None:
    with pytest.raises(ResourceSliceError, match=message):
        resource_slice(node, cards, unit, generation)


def test_the_live_slice_is_current_whatever_its_generation_and_quantity_spelling() -> None:
    cards = simulated_cards("n1", SPEC)
    desired = resource_slice("n1", cards, GIB, 1)
    live = resource_slice("n1", cards, GIB, 7)
    live["spec"]["devices"][0]["capacity"]["memory"]["value"] = "80Gi"  # how the API server spells 81920Mi
    assert slice_current(live, desired)
    cards[0] = replace(cards[0], model="A100-SXM4-80GB")
    assert not slice_current(live, resource_slice("n1", cards, GIB, 1))


def test_changes_name_each_card_added_dropped_or_changed() -> None:
    cards = simulated_cards("n1", SPEC)
    before = resource_slice("n1", cards, GIB, 1)
    cards[0] = cards[0].with_health(False)
    cards[2] = replace(cards[2], memory_mib=16384)
    after = resource_slice("n1", cards, GIB, 2)
    # card 1 loses its NVLink clique with card 0
    assert device_changes(before, after) == ["no longer offers card-0", "changes card-1", "changes card-2"]
    assert device_changes(None, before) == ["offers card-0", "offers card-1", "offers card-2"]


def test_device_names_round_trip_and_bad_ones_are_refused() -> None:
    assert format_device_name(12) == "card-12" and parse_device_name("card-12") == 12
    for bad in ("card12", "card-", "card-01", "card--1", "card-x", "gpu-1", "card-\u0661"):
        with pytest.raises(DraDeviceNameError, match="is not card-<NVML index>"):
            parse_device_name(bad)
    with pytest.raises(DraDeviceNameError):
        format_device_name(-1)


def test_the_cards_a_slice_offers_read_back_in_bytes_with_the_nodes_unit() -> None:
    cards = simulated_cards("n1", SPEC)
    live = resource_slice("n1", cards, MemoryUnit(512), 1)
    live["spec"]["devices"][0]["capacity"]["memory"]["value"] = "80Gi"  # how the API server spells 81920Mi
    assert offered_cards(live) == tuple(
        OfferedCard(f"card-{c.index}", c.index, c.uuid, c.model, c.memory_mib << 20, 512 << 20) for c in cards
    )


@pytest.mark.parametrize(
    ("path", "value", "field", "fault"),
    [
        (("name",), "gpu0", "name", "device name 'gpu0' is not card-<NVML index>"),
        (("capacity", "memory", "value"), "lots", "capacity.memory.value", "'lots' is not a positive whole number"),
        (("capacity", "memory", "requestPolicy", "default"), "0", "capacity.memory.requestPolicy.default", "'0' is"),
        (("capacity",), None, "capacity.memory.value", "None is not a positive whole number of bytes"),
    ],
)
def test_a_device_that_cannot_be_read_is_named(path: tuple[str, ...], value: object, field: str, fault: str) -> None:
    live = resource_slice("n1", simulated_cards("n1", SPEC), GIB, 1)
    device = live["spec"]["devices"][1]
    for key in path[:-1]:
        device = device[key]
    device[path[-1]] = value
    with pytest.raises(ResourceSliceError) as err:
        offered_cards(live)
    assert str(err.value).startswith(f"ResourceSlice n1-gpu.gpushare.io: spec.devices[1].{field}: {fault}")
