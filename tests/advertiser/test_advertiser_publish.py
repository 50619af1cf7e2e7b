"""The advertiser keeps the node's inventory annotation and model label true, and only writes on change."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpushare.advertiser.agent import Advertiser
from gpushare.advertiser.publish import node_patch
from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.inventory import NodeInventory, format_inventory, parse_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY, NODE_LABEL_MODEL
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend, simulated_cards
from gpushare.kube.objects import get_node
from gpushare.kube.retry import Backoff
from gpushare.sandbox.apiserver import ApiServer

SPEC = "2xA100-80GB:81920,1xT4:15360"


def inventory(api: client.ApiClient) -> NodeInventory:
    return parse_inventory(get_node(api, "n1")["metadata"]["annotations"][NODE_ANN_INVENTORY], "n1")


@pytest.fixture
def node(core_v1: client.CoreV1Api) -> None:
    core_v1.create_node({"metadata": {"name": "n1", "labels": {NODE_LABEL_MODEL: "stale"}}})


def test_publishes_every_card_field_and_the_model_label(kube_api: client.ApiClient, node: None) -> None:
    backend = SimulatedBackend("n1", SPEC)
    assert Advertiser(kube_api, "n1", backend, GIB).publish_once() is True
    inv = inventory(kube_api)
    assert inv.unit == GIB and inv.cards == tuple(backend.cards())
    assert get_node(kube_api, "n1")["metadata"]["labels"][NODE_LABEL_MODEL] == "A100-80GB_T4"


def test_no_patch_when_nothing_changed(kube_api: client.ApiClient, node: None) -> None:
    advertiser = Advertiser(kube_api, "n1", SimulatedBackend("n1", SPEC), GIB)
    advertiser.publish_once()
    rv = get_node(kube_api, "n1")["metadata"]["resourceVersion"]
    assert advertiser.publish_once() is False
    assert get_node(kube_api, "n1")["metadata"]["resourceVersion"] == rv


def test_cards_that_disappear_drop_out_and_the_label_goes_with_the_last() -> None:
    cards = simulated_cards("n1", SPEC)
    published = {
        "metadata": {
            "annotations": {NODE_ANN_INVENTORY: format_inventory(cards, GIB)},
            "labels": {NODE_LABEL_MODEL: "A100-80GB_T4"},
        }
    }
    patch = node_patch(published, cards[:2], GIB)
    kept = parse_inventory(patch["metadata"]["annotations"][NODE_ANN_INVENTORY])
    assert [card.uuid for card in kept.cards] == [cards[0].uuid, cards[1].uuid]
    assert patch["metadata"]["labels"] == {NODE_LABEL_MODEL: "A100-80GB"}
    assert node_patch(published, [], GIB)["metadata"]["labels"] == {NODE_LABEL_MODEL: None}


@pytest.fixture
def running(kube_api: client.ApiClient, node: None) -> Iterator[tuple[Advertiser, SimulatedBackend]]:
    backend = SimulatedBackend("n1", SPEC)
    advertiser = Advertiser(kube_api, "n1", backend, GIB, interval=3600, backoff=Backoff(initial=0.05, maximum=0.2))
    advertiser.start()
    yield advertiser, backend
    advertiser.stop()


def test_health_event_is_published_at_once(kube_api: client.ApiClient, running) -> None:
    advertiser, backend = running
    assert advertiser.published.wait(5)
    t4 = backend.cards()[2]
    backend.inject_xid(t4.uuid, 79)
    wait_until(lambda: not inventory(kube_api).cards[2].healthy, 5, "the unhealthy card to be published")
    backend.recover(t4.uuid)
    wait_until(lambda: inventory(kube_api).cards[2].healthy, 5, "the recovery to be published")


def test_rides_out_an_api_outage(apiserver: ApiServer, kube_api: client.ApiClient, running) -> None:
    advertiser, backend = running
    assert advertiser.published.wait(5)
    apiserver.pause()
    backend.inject_xid(backend.cards()[0].uuid, 79)  # happens while the API server is down
    apiserver.resume()
    wait_until(lambda: not inventory(kube_api).cards[0].healthy, 10, "the change made during the outage")
