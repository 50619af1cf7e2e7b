"""Moving from the original (Alibaba) gpushare node by node, and back: both sides must see the same
cards, the same pods and the same amounts at every step."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from kubernetes import client
from podfactory import container, gpu_pod
from test_deviceplugin_integration import SimNode, visible
from test_extender_contract import Extender

from gpushare import contract as c
from gpushare.cards import Card
from gpushare.cli import kubectl_inspect_main
from gpushare.inspectview import build_node
from gpushare.kube import get_pod
from gpushare.usage import held_units, node_inventory, node_usage, pod_allocation

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ext(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> Iterator[Extender]:
    """The extender over the nodes "mixed" (2 x 80 GiB + 15 GiB, minors backwards) and "small" (24 GiB)."""
    extender = Extender(kube_api, core_v1)
    yield extender
    extender.conn.close()
    extender.running.stop()


@pytest.fixture
def node(kube_api: client.ApiClient, core_v1: client.CoreV1Api, directory: Path) -> Iterator[SimNode]:
    """Node n1's device plugin and kubelet emulator; the node object is the test's to create."""
    sim = SimNode(kube_api, core_v1, directory)
    sim.start_plugin()
    yield sim
    sim.stop_plugin()
    sim.kubelet.stop()


def original_node(core: client.CoreV1Api, name: str, mem: int, count: int, ip: str = "10.0.0.7") -> None:
    """A node that runs the original device plugin: no inventory annotation, only its status."""
    core.create_node({"metadata": {"name": name}})
    amounts = {c.RESOURCE_MEM: str(mem), c.RESOURCE_COUNT: str(count)}
    core.patch_node_status(
        name,
        {"status": {"capacity": amounts, "allocatable": amounts, "addresses": [{"type": "InternalIP", "address": ip}]}},
    )


def original_inspect_usage(pod: dict[str, Any]) -> dict[int, int]:
    """What the original kubectl-inspect-gpushare counts for a pod: the framework annotation summed
    per card when it is there, else the pod's app-container gpu-mem on its IDX card."""
    ann = pod["metadata"].get("annotations") or {}
    if c.ANN_FRAMEWORK_ALLOCATION in ann:
        per_card: dict[int, int] = {}
        for cards in json.loads(ann[c.ANN_FRAMEWORK_ALLOCATION]).values():
            for number, units in cards.items():
                per_card[int(number)] = per_card.get(int(number), 0) + units
        return per_card
    return {int(ann[c.ANN_MEM_IDX]): c.parse_pod_request(pod).app_mem}


# --- point 1: nodes that still run the original device plugin --------------------------------------------


def test_a_node_running_the_original_plugin_is_scheduled_from_its_status(ext: Extender) -> None:
    original_node(ext.core, "legacy", 32, 2)
    wait_until(lambda: ext.running.cache.view("legacy"), what="the legacy node in the extender's cache")
    # a pod the original extender placed there holds card 0
    ext.core.create_namespaced_pod("default", gpu_pod("old", [container("main", 12)], node="legacy", original_index=0))
    wait_until(lambda: ext.used("legacy") == [12, 0], what="the original pod counted on card 0")

    pod = ext.pending(gpu_pod("p", [container("main", 10)]))
    reply = ext.call("filter", {"Pod": pod, "NodeNames": ["legacy"]})
    assert reply["NodeNames"] == ["legacy"], reply
    assert ext.bind(pod, "legacy") == {"Error": ""}
    ann = ext.annotations("p")
    # only what the original device plugin reads: its card number, the node total / cards, no UUIDs
    assert c.ANN_ALLOCATION not in ann
    assert ann[c.ANN_MEM_DEV] == "16" and ann[c.ANN_MEM_POD] == "10" and ann[c.ANN_MEM_ASSIGNED] == "false"
    assert json.loads(ann[c.ANN_FRAMEWORK_ALLOCATION]) == {"0": {ann[c.ANN_MEM_IDX]: 10}}
    wait_until(lambda: sorted(ext.used("legacy")) == [10, 12], what="both pods counted")

    # what that plugin can't serve is refused there, with the reason
    pair = ext.pending(gpu_pod("pair", [container("main", 4, 2)]))
    reply = ext.call("filter", {"Pod": pair, "NodeNames": ["legacy", "mixed"]})
    assert reply["NodeNames"] == ["mixed"]
    assert "runs the original gpushare device plugin" in reply["FailedNodes"]["legacy"]
    assert "runs the original gpushare device plugin" in ext.bind(pair, "legacy")["Error"]


def test_cards_are_inferred_from_allocatable_in_the_original_unit() -> None:
    status = {
        "capacity": {c.RESOURCE_MEM: "65536", c.RESOURCE_COUNT: "4"},
        "allocatable": {c.RESOURCE_MEM: "61440", c.RESOURCE_COUNT: "4"},
    }
    inventory = node_inventory({"metadata": {"name": "mib"}, "status": status})
    assert inventory.unit.name == "MiB"  # more than 100 units a card, as the original inspect decides
    assert [inventory.units_of(card) for card in inventory.cards] == [15360] * 4
    assert [card.minor for card in inventory.cards] == [0, 1, 2, 3]
    ours = {"metadata": {"name": "ours"}, "status": {"capacity": {c.RESOURCE_MEM: "80", c.RESOURCE_COUNT: "80"}}}
    with pytest.raises(c.ContractError, match="counts replicas, not cards"):
        node_inventory(ours)


# --- point 2: the original URL prefix and inspect JSON ----------------------------------------------------


def test_the_original_url_prefix_answers_filter_bind_and_inspect(ext: Extender) -> None:
    pod = ext.pending(gpu_pod("p", [container("main", 20)]))
    status, reply = ext.raw("gpushare-scheduler/filter", json.dumps({"Pod": pod, "NodeNames": ["small"]}).encode())
    assert status == 200 and reply["NodeNames"] == ["small"]
    meta = pod["metadata"]
    args = {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "small"}
    status, reply = ext.raw("gpushare-scheduler/bind", json.dumps(args).encode())
    assert status == 200 and reply == {"Error": ""}
    wait_until(lambda: ext.used("small") == [20], what="the bound pod counted")

    status, body = ext.get("/gpushare-scheduler/inspect/small")
    assert status == 200
    assert json.loads(body) == {
        "nodes": [
            {
                "name": "small",
                "totalGPU": 24,
                "usedGPU": 20,
                "devs": [
                    {
                        "id": 0,
                        "totalGPU": 24,
                        "usedGPU": 20,
                        "pods": [{"name": "p", "namespace": "default", "usedGPU": 20}],
                    }
                ],
            }
        ]
    }
    status, body = ext.get("/gpushare-scheduler/inspect")
    assert status == 200 and {n["name"] for n in json.loads(body)["nodes"]} == {"mixed", "small"}
    status, body = ext.get("/gpushare-scheduler/inspect/ghost")
    assert status == 404 and "ghost" in json.loads(body)["error"]


# --- point 3: cards fenced by the original's ConfigMap ----------------------------------------------------


def test_cards_listed_in_the_unhealthy_gpu_configmap_take_no_pods(ext: Extender) -> None:
    minors = {card.minor: card.index for card in ext.backends["mixed"].cards()}
    ext.core.create_namespaced_config_map(
        "kube-system",
        {"metadata": {"name": "unhealthy-gpu-mixed"}, "data": {"gpus": ",".join(str(m) for m in sorted(minors)[:2])}},
    )
    fenced = {minors[m] for m in sorted(minors)[:2]}
    open_card = ({0, 1, 2} - fenced).pop()
    wait_until(
        lambda: not any(card.healthy for card in ext.running.cache.view("mixed").cards if card.index in fenced),
        what="the fenced cards in the extender's view",
    )
    pod = ext.pending(gpu_pod("p", [container("main", 2)]))
    assert ext.bind(pod, "mixed") == {"Error": ""}
    assert [s.index for s in c.parse_allocation(ext.annotations("p")[c.ANN_ALLOCATION])["main"]] == [open_card]
    ext.core.delete_namespaced_config_map("unhealthy-gpu-mixed", "kube-system")
    wait_until(lambda: all(card.healthy for card in ext.running.cache.view("mixed").cards), what="the fence lifted")


# --- point 4: cgpu.disable.isolation ------------------------------------------------------------------


def test_the_cgpu_label_puts_cgpu_disable_in_the_env(node: SimNode) -> None:
    node.core.create_node({"metadata": {"name": "n1", "labels": {c.NODE_LABEL_CGPU_DISABLE: "true"}}})
    card = node.cards[0]
    admission = node.admit(
        gpu_pod("isolated-off", [container("main", 2)], allocation={"main": (c.CardSlice(card.index, card.uuid, 2),)})
    )
    assert visible(admission) == card.uuid
    assert admission.containers["main"].envs[c.ENV_CGPU_DISABLE] == "true"
    node.core.patch_node("n1", {"metadata": {"labels": {c.NODE_LABEL_CGPU_DISABLE: None}}})
    admission = node.admit(
        gpu_pod("isolated", [container("main", 2)], allocation={"main": (c.CardSlice(card.index, card.uuid, 2),)})
    )
    assert c.ENV_CGPU_DISABLE not in admission.containers["main"].envs


# --- point 5: what the original components see of our multi-card and whole-card pods ---------------------


def test_multi_card_and_whole_card_pods_are_counted_right_by_the_original_components(ext: Extender) -> None:
    pair = ext.pending(gpu_pod("pair", [container("main", 16, 2)]))
    assert ext.bind(pair, "mixed") == {"Error": ""}
    whole = ext.pending(gpu_pod("whole", [container("main", 0, 1)]))
    assert ext.bind(whole, "mixed") == {"Error": ""}
    cards = ext.backends["mixed"].cards()
    per_card = sum(card.memory_mib // 1024 for card in cards) // len(cards)  # 58, as the original computes
    pair_pod, whole_pod = (get_pod(ext.api, "default", name) for name in ("pair", "whole"))
    # the original inspect: 8 on each of the pair's two cards, not 16 on the first
    assert sorted(original_inspect_usage(pair_pod).values()) == [8, 8]
    # the whole card is full in the original's eyes, not free (_POD was 0 before)
    whole_ann = whole_pod["metadata"]["annotations"]
    assert whole_ann[c.ANN_MEM_POD] == whole_ann[c.ANN_MEM_DEV] == str(per_card)
    assert original_inspect_usage(whole_pod) == {int(whole_ann[c.ANN_MEM_IDX]): per_card}
    # the original extender counts _POD on the _IDX card: the pair holds 8 there
    pair_ann = pair_pod["metadata"]["annotations"]
    assert pair_ann[c.ANN_MEM_POD] == "8" and pair_ann[c.ANN_MEM_DEV] == str(per_card)


# --- point 6: one rule for what a pod holds ---------------------------------------------------------------

THREE = tuple(Card(i, f"GPU-{i}", "T4", 16384, minor=i) for i in range(3))
FRAMEWORK_POD = {
    "metadata": {
        "name": "fw",
        "namespace": "default",
        "uid": "u-fw",
        "annotations": {c.ANN_FRAMEWORK_ALLOCATION: json.dumps({"0": {"0": 10}, "1": {"2": 5}}), c.ANN_MEM_IDX: "0"},
    },
    "spec": {
        "nodeName": "n",
        "containers": [
            {"name": "a", "resources": {"limits": {c.RESOURCE_MEM: "10"}}},
            {"name": "b", "resources": {"limits": {c.RESOURCE_MEM: "5"}}},
        ],
    },
    "status": {"phase": "Running"},
}


def test_every_component_counts_the_framework_annotation_the_same() -> None:
    annotated = {
        "metadata": {"name": "n", "annotations": {c.NODE_ANN_INVENTORY: c.format_inventory(THREE, c.GIB)}},
        "status": {},
    }
    used, _, bad = node_usage([FRAMEWORK_POD], THREE)  # the device plugin's and the CRI shim's count
    assert bad == [] and used == {"GPU-0": 10, "GPU-1": 0, "GPU-2": 5}
    view = build_node(annotated, [FRAMEWORK_POD])  # inspect's
    assert [card.allocated for card in view.cards] == [10, 0, 5]
    assert view.pods[0].units == {0: 10, 2: 5}


# --- point 7: init containers --------------------------------------------------------------------------


def test_an_init_container_runs_inside_the_app_containers_share(ext: Extender) -> None:
    filler = ext.pending(gpu_pod("filler", [container("main", 18)]))
    assert ext.bind(filler, "small") == {"Error": ""}
    pod = ext.pending(gpu_pod("p", [container("a", 4), container("b", 2)], init=[container("warmup", 2)]))
    reply = ext.call("filter", {"Pod": pod, "NodeNames": ["small"]})
    assert reply["NodeNames"] == ["small"], reply  # 6 of the card's 6 free, not 8
    assert ext.bind(pod, "small") == {"Error": ""}
    wait_until(lambda: ext.used("small") == [24], what="the card counted full, not over-committed")
    bound = get_pod(ext.api, "default", "p")
    allocation = pod_allocation(bound, ext.backends["small"].cards())
    assert sum(held_units(allocation, c.parse_pod_request(bound)).values()) == 6
    assert c.parse_pod_request(bound).effective_mem == 6


def test_allocate_env_and_inspect_use_the_effective_request(node: SimNode) -> None:
    card = node.cards[2]
    slices = {name: (c.CardSlice(card.index, card.uuid, units),) for name, units in (("init", 9), ("main", 6))}
    pod = gpu_pod("p", [container("main", 6)], init=[container("init", 9)], allocation=slices)
    admission = node.admit(pod)
    assert admission.admitted, admission.error
    assert admission.containers["main"].envs[c.ENV_MEM_POD] == "9" == admission.containers["init"].envs[c.ENV_MEM_POD]
    # a second pod fits next to it: the card holds max(6, 9) = 9 of 15, not 15
    assert node.admit(
        gpu_pod("q", [container("main", 6)], allocation={"main": (c.CardSlice(card.index, card.uuid, 6),)})
    ).admitted


# --- point 9: kubectl inspect gpushare ------------------------------------------------------------------


def test_kubectl_inspect_gpushare_keeps_the_original_layout(
    core_v1: client.CoreV1Api, kubeconfig: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-inspect-gpushare"] == "gpushare.cli:kubectl_inspect_main"
    original_node(core_v1, "legacy", 32, 2)
    framework = {"0": {"0": 6}, "1": {"0": 4}}  # per card, as the newer original extender writes it
    pod = gpu_pod("fw", [container("a", 6), container("b", 4)], node="legacy", original_index=1)
    pod["metadata"]["annotations"][c.ANN_FRAMEWORK_ALLOCATION] = json.dumps(framework)
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
