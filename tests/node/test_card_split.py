"""``gpushare node --dra --dra-cards``: each card is offered one way, by the device plugin (and so the
extender) or by the DRA driver, never both."""

from __future__ import annotations

from pathlib import Path

import pytest

from advertiser.resourceslice import resource_slice
from gpushare.cli import main
from gpushare.contract.inventory import format_inventory, parse_inventory
from gpushare.contract.units import GIB
from gpushare.gpus.backend import HealthEvent, InventoryError
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.gpus.split import EVERY_CARD, parse_dra_cards, split_cards

SPEC = "4xA100-80GB:81920"


def test_the_inventory_and_the_slice_list_disjoint_cards_that_cover_the_node() -> None:
    backend = SimulatedBackend("n1", SPEC)
    third = backend.cards()[3].uuid
    plugin, dra = split_cards(backend, parse_dra_cards(f"2,{third}"))

    inventory = parse_inventory(format_inventory(plugin.cards(), GIB), "n1")
    offered = resource_slice("n1", dra.cards(), GIB, 1)["spec"]["devices"]
    assert [c.index for c in inventory.cards] == [0, 1]
    assert [d["name"] for d in offered] == ["card-2", "card-3"]


def test_every_card_goes_to_dra_by_default() -> None:
    plugin, dra = split_cards(SimulatedBackend("n1", SPEC), EVERY_CARD)
    assert plugin.cards() == [] and [c.index for c in dra.cards()] == [0, 1, 2, 3]


def test_a_health_event_reaches_only_the_way_that_owns_the_card() -> None:
    backend = SimulatedBackend("n1", SPEC)
    plugin, dra = split_cards(backend, parse_dra_cards("3"))
    heard: dict[str, list[HealthEvent]] = {"plugin": [], "dra": []}
    plugin.subscribe(heard["plugin"].append)
    dra.subscribe(heard["dra"].append)

    backend.inject_xid(backend.cards()[3].uuid, 79)
    backend.inject_xid(backend.cards()[0].uuid, 79)

    assert [e.uuid for e in heard["dra"]] == [backend.cards()[3].uuid]
    assert [e.uuid for e in heard["plugin"]] == [backend.cards()[0].uuid]
    assert not dra.cards()[0].healthy  # the subset reads health from the backend
    dra.close()
    backend.recover(backend.cards()[3].uuid)
    assert len(heard["dra"]) == 1  # closed: no more events


def test_a_memory_limit_is_not_set_through_the_other_way() -> None:
    backend = SimulatedBackend("n1", SPEC)
    plugin, _ = split_cards(backend, parse_dra_cards("0"))
    with pytest.raises(InventoryError, match=backend.cards()[0].uuid):
        plugin.set_memory_limit(backend.cards()[0].uuid, Path("/sys/fs/cgroup/x"), 1, 1)


@pytest.mark.parametrize(
    ("text", "named"),
    [("1,x7", "x7 is neither"), ("", "expected 'all'"), (" , ", "expected 'all'"), ("GPU", "GPU is neither")],
)
def test_a_malformed_dra_cards_is_refused_naming_the_part(text: str, named: str) -> None:
    with pytest.raises(InventoryError, match=named):
        parse_dra_cards(text)


def test_a_card_the_node_does_not_have_is_refused_with_the_cards_it_has() -> None:
    backend = SimulatedBackend("n1", SPEC)
    with pytest.raises(InventoryError, match=r"names 7, not a card of this node \(cards: 0 \(GPU-"):
        split_cards(backend, parse_dra_cards("1,7"))


def test_dra_cards_without_dra_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["node", "--node-name", "n1", "--gpus", f"sim:{SPEC}", "--dra-cards", "1", "--metrics-port", "0"]) != 0
    assert "--dra-cards picks the cards the DRA driver offers: it needs --dra" in capsys.readouterr().err


def test_dra_order_without_dra_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["node", "--node-name", "n1", "--gpus", f"sim:{SPEC}", "--dra-order", "best-fit", "--metrics-port", "0"]
    assert main(args) != 0
    assert "--dra-order orders the DRA driver's ResourceSlice: it needs --dra" in capsys.readouterr().err
