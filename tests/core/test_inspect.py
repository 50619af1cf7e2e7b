"""``gpushare inspect``: the tables a user reads, for mixed cards and units, and through the API."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from kubernetes import client
from support.inspecting import mem, node, placed, pod, rows

from gpushare.cards import ENFORCED
from gpushare.cli import main
from gpushare.contract import names
from gpushare.contract.names import ANN_ALLOCATION, ANN_MEM_IDX, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import MemoryUnit
from gpushare.gpus.simulated import SIMULATED_LIMITS, simulated_cards
from gpushare.inspection.render import render_details, render_summary
from gpushare.inspection.views import build_cluster

# node "big": an 80 GiB card whose driver enforces memory limits and an unhealthy 15 GiB card, in GiB
BIG = list(simulated_cards("big", "1xA100-80GB:81920,1xT4:15360"))
BIG[0] = replace(BIG[0], memory_limits=ENFORCED)
BIG[1] = BIG[1].with_health(False)
# node "small": two 16 GiB cards counted in 512 MiB units (32 each)
SMALL = simulated_cards("small", "2xV100-16GB:16384")
HALF_GIB = MemoryUnit(512)


def cluster_objects() -> tuple[list[dict], list[dict]]:
    nodes = [
        node("big", "10.0.0.1", BIG),
        node("small", "10.0.0.2", SMALL, HALF_GIB),
        node("cpu-only", "10.0.0.3"),
    ]
    pods = [
        pod("shared-a", "big", {"main": mem(8)}, placed(main=[(BIG[0], 8)])),
        # placed by the original extender, which names the card by its /dev/nvidia minor
        pod("shared-b", "big", {"main": mem(4)}, {ANN_MEM_IDX: str(BIG[1].minor)}),
        pod(
            "two-containers",
            "big",
            {"app": mem(6), "sidecar": mem(2)},
            placed(app=[(BIG[0], 6)], sidecar=[(BIG[1], 2)]),
        ),
        pod("waiting", "big", {"main": mem(5)}),  # bound, no card recorded
        pod("done", "big", {"main": mem(70)}, placed(main=[(BIG[0], 70)]), phase="Succeeded"),
        pod("two-cards", "small", {"main": mem(20, 2)}, placed(main=[(SMALL[0], 10), (SMALL[1], 10)])),
        pod("broken", "small", {"main": mem(4)}, {ANN_ALLOCATION: "{not json"}),
        pod("unscheduled", None, {"main": mem(500)}),
        pod("web", "cpu-only", {"main": {}}),
    ]
    return nodes, pods


def test_summary_shows_each_card_in_its_nodes_unit() -> None:
    nodes, pods = cluster_objects()
    text = render_summary(build_cluster(nodes, pods))
    table = rows(text)
    assert table["NAME"] == [
        "NAME",
        "IPADDRESS",
        "UNIT",
        "GPU0(Allocated/Total)",
        "GPU1(Allocated/Total)",
        "PENDING(Allocated)",
        "GPU Memory(Allocated/Total)",
        "MODEL",
        "LIMITS",
    ]
    assert table["big"] == [
        "big",
        "10.0.0.1",
        "GiB",
        "14/80",
        "6/15 (unhealthy)",
        "5 (1 pod)",
        "20/95 (21%)",
        "A100-80GB (GPU0), T4 (GPU1)",
        "enforced (GPU0), off (GPU1)",
    ]
    assert table["small"] == ["small", "10.0.0.2", "512MiB", "10/32", "10/32", "20/64 (31%)", "V100-16GB", "off"]
    assert "cpu-only" not in table
    # the units differ between nodes, so the cluster total is converted to MiB: 20 GiB + 20 x 512 MiB
    assert "Allocated/Total GPU memory in cluster: 30720/130048 MiB (23%)" in text
    assert "warning: node small: pod team/broken annotation gpushare.io/allocation: not valid JSON" in text
    assert "1 pod(s) requesting GPUs are not bound to a node yet: team/unscheduled" in text.splitlines()


def test_the_pods_not_bound_yet_are_named_the_first_ten_then_how_many_more() -> None:
    nodes, _ = cluster_objects()
    waiting = [pod(f"wait-{i:02d}", None, {"main": mem(4)}) for i in range(12)]
    text = render_summary(build_cluster(nodes, waiting))
    named = ", ".join(f"team/wait-{i:02d}" for i in range(10))
    assert f"12 pod(s) requesting GPUs are not bound to a node yet: {named} and 2 more" in text


def test_details_list_each_pod_per_card() -> None:
    nodes, pods = cluster_objects()
    text = render_details(build_cluster(nodes, pods))
    big, small = text.split("NAME:       small")
    big_rows = rows(big)
    assert big_rows["NAME"] == ["NAME", "NAMESPACE", "GPU0(Allocated)", "GPU1(Allocated)", "PENDING(Allocated)"]
    assert big_rows["shared-a"] == ["shared-a", "team", "8", "0", "0"]
    assert big_rows["shared-b"] == ["shared-b", "team", "0", "4", "0"]
    assert big_rows["two-containers"] == ["two-containers", "team", "6", "2", "0"]
    assert big_rows["waiting"] == ["waiting", "team", "0", "0", "5"]
    assert "done" not in big_rows
    assert "Allocated:  20 GiB (21%)" in big and "Total:      95 GiB" in big
    assert "MODEL:      A100-80GB (GPU0), T4 (GPU1)" in big and "MODEL:      V100-16GB" in small
    assert f"LIMITS:     enforced (GPU0); off (GPU1): {SIMULATED_LIMITS}" in big
    assert f"LIMITS:     off: {SIMULATED_LIMITS}" in small
    small_rows = rows(small)
    assert small_rows["two-cards"] == ["two-cards", "team", "10", "10"]
    assert "Allocated:  20 x 512MiB (31%)" in small and "Total:      64 x 512MiB" in small


def test_same_unit_everywhere_keeps_the_cluster_total_in_that_unit() -> None:
    nodes = [node("a", "10.0.0.1", BIG), node("b", "10.0.0.2", SMALL)]
    pods = [pod("p", "b", {"main": mem(16)}, placed(main=[(SMALL[1], 16)]))]
    text = render_summary(build_cluster(nodes, pods))
    assert rows(text)["b"] == ["b", "10.0.0.2", "GiB", "0/16", "16/16", "16/32 (50%)", "V100-16GB", "off"]
    assert rows(text)["a"][3:5] == ["0/80", "0/15 (unhealthy)"]
    assert "Allocated/Total GPU memory in cluster: 16/127 GiB (12%)" in text


def test_node_without_inventory_falls_back_to_capacity_and_says_so() -> None:
    legacy = node("legacy", "10.0.0.9", capacity={RESOURCE_MEM: "30", RESOURCE_COUNT: "2"})
    pods = [pod("old", "legacy", {"main": mem(12)}, {ANN_MEM_IDX: "1"})]
    text = render_summary(build_cluster([legacy], pods))
    # the capacity says nothing of the cards' model, and the original plugin enforces no memory limits
    assert rows(text)["legacy"] == ["legacy", "10.0.0.9", "GiB", "0/15", "12/15", "12/30 (40%)", "-", "off"]
    assert "note: node legacy: no gpushare.io/inventory annotation: 2 equal card(s) of 15 GiB inferred from" in text


def test_gpu_count_replicas_are_not_taken_for_cards() -> None:
    # our plugin lists one gpu-count replica per unit: without the inventory, cards can't be counted
    ours = node("ours", "10.0.0.8", capacity={RESOURCE_MEM: "30", RESOURCE_COUNT: "30"})
    text = render_summary(build_cluster([ours], []))
    assert rows(text)["ours"] == ["ours", "10.0.0.8", "GiB", "0/0 (0%)", "-", "-"]
    assert "warning: node ours: node ours has no gpushare.io/inventory annotation; its aliyun.com/gpu-count=30" in text


def test_overcommitted_card_is_flagged() -> None:
    pods = [
        pod("x", "b", {"main": mem(12)}, placed(main=[(SMALL[0], 12)])),
        pod("y", "b", {"main": mem(8)}, placed(main=[(SMALL[0], 8)])),
    ]
    text = render_summary(build_cluster([node("b", "10.0.0.2", SMALL)], pods))
    assert rows(text)["b"][3] == "20/16 (over-committed)"


def test_empty_cluster_says_so() -> None:
    assert render_summary(build_cluster([node("cpu", "10.0.0.1")], [])).startswith("no node has gpushare GPUs")


def test_inspect_through_the_api(
    core_v1: client.CoreV1Api, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, pods = cluster_objects()
    for n in nodes:
        core_v1.create_node(n)
    for p in pods:
        core_v1.create_namespaced_pod("team", p)

    assert main(["inspect", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert rows(out)["big"][3:5] == ["14/80", "6/15 (unhealthy)"]
    assert "Allocated/Total GPU memory in cluster: 30720/130048 MiB (23%)" in out

    assert main(["inspect", "-d", "small", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "NAME:       small" in out and "NAME:       big" not in out
    assert rows(out)["two-cards"] == ["two-cards", "team", "10", "10"]

    assert main(["inspect", "nowhere", "--kubeconfig", str(kubeconfig)]) == 1
    assert "node nowhere: not found" in capsys.readouterr().err
    assert main(["inspect", "cpu-only", "--kubeconfig", str(kubeconfig)]) == 1
    assert "node cpu-only has no gpushare GPUs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("ledger", "fault"),
    [(None, "is missing, though gpushare.io/bind-sequence='3'"), ("{not json", "expected an object")],
)
def test_a_damaged_ledger_is_warned_about(ledger: str | None, fault: str) -> None:
    damaged = node("b", "10.0.0.2", SMALL)
    damaged["metadata"]["annotations"][names.NODE_ANN_BIND_SEQUENCE] = "3"
    if ledger is not None:
        damaged["metadata"]["annotations"][names.NODE_ANN_PENDING_BINDS] = ledger
    pods = [pod("x", "b", {"main": mem(12)}, placed(main=[(SMALL[1], 12)]))]
    text = render_summary(build_cluster([damaged], pods))
    assert f"warning: node b: node b annotation {names.NODE_ANN_PENDING_BINDS}" in text and fault in text
    assert "counted by their own annotations, which their owners can rewrite" in text
