"""Moving from the original (Alibaba) gpushare node by node, and back: both sides must see the same
cards, the same pods and the same amounts at every step.

The tests that need a running extender are in tests/extender/test_extender.py, those that need a device
plugin in tests/deviceplugin/test_deviceplugin_integration.py (section "moving from the original gpushare")."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from kubernetes import client
from podfactory import container, gpu_pod
from support.original import original_node

from gpushare.cards import Card
from gpushare.cli import kubectl_inspect_main
from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import NodeInventory, format_inventory
from gpushare.contract.names import (
    ANN_FRAMEWORK_ALLOCATION,
    ANN_MEM_IDX,
    NODE_ANN_INVENTORY,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.units import GIB
from gpushare.holdings.node import node_inventory, node_usage
from gpushare.inspection.views import build_node

ROOT = Path(__file__).resolve().parents[2]


# --- nodes that still run the original device plugin --------------------------------------------


def test_cards_are_inferred_from_allocatable_in_the_original_unit() -> None:
    status = {
        "capacity": {RESOURCE_MEM: "65536", RESOURCE_COUNT: "4"},
        "allocatable": {RESOURCE_MEM: "61440", RESOURCE_COUNT: "4"},
    }
    inventory = node_inventory({"metadata": {"name": "mib"}, "status": status})
    assert inventory.unit.name == "MiB"  # more than 100 units a card, as the original inspect decides
    assert [inventory.units_of(card) for card in inventory.cards] == [15360] * 4
    assert [card.minor for card in inventory.cards] == [0, 1, 2, 3]
    ours = {"metadata": {"name": "ours"}, "status": {"capacity": {RESOURCE_MEM: "80", RESOURCE_COUNT: "80"}}}
    with pytest.raises(ContractError, match="counts replicas, not cards"):
        node_inventory(ours)


# --- one rule for what a pod holds ---------------------------------------------------------------

THREE = tuple(Card(i, f"GPU-{i}", "T4", 16384, minor=i) for i in range(3))
FRAMEWORK_POD = {
    "metadata": {
        "name": "fw",
        "namespace": "default",
        "uid": "u-fw",
        "annotations": {ANN_FRAMEWORK_ALLOCATION: json.dumps({"0": {"0": 10}, "1": {"2": 5}}), ANN_MEM_IDX: "0"},
    },
    "spec": {
        "nodeName": "n",
        "containers": [
            {"name": "a", "resources": {"limits": {RESOURCE_MEM: "10"}}},
            {"name": "b", "resources": {"limits": {RESOURCE_MEM: "5"}}},
        ],
    },
    "status": {"phase": "Running"},
}


def test_every_component_counts_the_framework_annotation_the_same() -> None:
    annotated = {
        "metadata": {"name": "n", "annotations": {NODE_ANN_INVENTORY: format_inventory(THREE, GIB)}},
        "status": {},
    }
    used, _, bad = node_usage(
        [FRAMEWORK_POD], NodeInventory(GIB, THREE)
    )  # the device plugin's and the CRI shim's count
    assert bad == [] and used == {"GPU-0": 10, "GPU-1": 0, "GPU-2": 5}
    view = build_node(annotated, [FRAMEWORK_POD])  # inspect's
    assert [card.allocated for card in view.cards] == [10, 0, 5]
    assert view.pods[0].units == {0: 10, 2: 5}


# --- kubectl inspect gpushare ------------------------------------------------------------------


def test_kubectl_inspect_gpushare_keeps_the_original_layout(
    core_v1: client.CoreV1Api, kubeconfig: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-inspect-gpushare"] == "gpushare.cli:kubectl_inspect_main"
    original_node(core_v1, "legacy", 32, 2)
    framework = {"0": {"0": 6}, "1": {"0": 4}}  # per card, as the newer original extender writes it
    pod = gpu_pod("fw", [container("a", 6), container("b", 4)], node="legacy", original_index=1)
    pod["metadata"]["annotations"][ANN_FRAMEWORK_ALLOCATION] = json.dumps(framework)
    core_v1.create_namespaced_pod("default", pod)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert kubectl_inspect_main(["--kubeconfig", str(kubeconfig)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "NAME",
        "IPADDRESS",
        "GPU0(Allocated/Total)",
        "GPU1(Allocated/Total)",
        "GPU",
        "Memory(GiB)",
    ]
    assert lines[1].split() == ["legacy", "10.0.0.7", "10/16", "0/16", "10/32"]
    assert set(lines[2]) == {"-"}
    assert lines[3:] == ["Allocated/Total GPU Memory In Cluster:", "10/32 (31%)"]

    assert kubectl_inspect_main(["-d", "legacy", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines()]
    assert ["NAME", "NAMESPACE", "GPU0(Allocated)", "GPU1(Allocated)"] in table
    assert ["Allocated", ":", "10", "(31%)"] in table and ["Total", ":", "32"] in table
    assert out.rstrip().endswith("Allocated/Total GPU Memory In Cluster:  10/32 (31%)")

    assert kubectl_inspect_main(["--layout", "gpushare", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "UNIT" in out.splitlines()[0] and "note: node legacy: no gpushare.io/inventory annotation" in out
