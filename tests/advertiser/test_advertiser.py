"""``gpushare advertiser`` as an operator runs it, and the periodic re-check that repairs the annotation."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpushare.advertiser.agent import Advertiser
from kubernetes import client
from support.waiting import wait_until

from gpushare.cli import main
from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY, NODE_LABEL_MODEL
from gpushare.contract.units import GIB, MemoryUnit
from gpushare.gpus.simulated import SimulatedBackend, simulated_cards
from gpushare.kube.objects import get_node, patch_node

SPEC = "1xA100-40GB:40960,1xT4:15360"


def published(api: client.ApiClient, node: str) -> NodeInventory | None:
    text = (get_node(api, node)["metadata"].get("annotations") or {}).get(NODE_ANN_INVENTORY)
    return parse_inventory(text, node) if text else None


def test_once_publishes_with_the_node_flags_and_exits(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api, kubeconfig: Path
) -> None:
    core_v1.create_node({"metadata": {"name": "n1"}})
    argv = ["advertiser", "--once", "--node-name", "n1", "--kubeconfig", str(kubeconfig), "--gpus", f"sim:{SPEC}"]
    assert main([*argv, "--memory-unit", "MiB"]) == 0
    inventory = published(kube_api, "n1")
    assert inventory.unit == MemoryUnit(1)
    assert [card.uuid for card in inventory.cards] == [card.uuid for card in simulated_cards("n1", SPEC)]
    assert get_node(kube_api, "n1")["metadata"]["labels"][NODE_LABEL_MODEL] == "A100-40GB_T4"


def test_once_without_a_node_object_fails_with_a_message(kubeconfig: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advertiser", "--once", "--node-name", "nowhere", "--kubeconfig", str(kubeconfig), "--gpus", f"sim:{SPEC}"]
    assert main(argv) == 1
    assert "node nowhere" in capsys.readouterr().err


def test_periodic_recheck_repairs_an_annotation_someone_else_changed(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    core_v1.create_node({"metadata": {"name": "n1"}})
    advertiser = Advertiser(kube_api, "n1", SimulatedBackend("n1", SPEC), GIB, interval=0.05)
    advertiser.start()
    try:
        wait_until(lambda: published(kube_api, "n1"), what="the first publication")
        patch_node(kube_api, "n1", {"metadata": {"annotations": {NODE_ANN_INVENTORY: None}}})
        wait_until(lambda: published(kube_api, "n1"), what="the re-check to publish the inventory again")
        assert len(published(kube_api, "n1").cards) == 2
    finally:
        advertiser.stop()
