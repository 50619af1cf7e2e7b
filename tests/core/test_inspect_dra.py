"""``gpushare inspect`` with the DRA driver gpu.gpushare.io: the cards a node's ResourceSlice offers are
cards of that node, held by ResourceClaims; what can't be counted on a card is said, never dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpushare.advertiser.resourceslice import resource_slice
from kubernetes import client, utils
from podfactory import container, gpu_pod, slices
from support.inspecting import dra_claim, mem, node, placed, pod, rows
from support.realapi import real_api_server

from gpushare.cli import main
from gpushare.contract.units import GIB, MemoryUnit
from gpushare.gpus.simulated import SIMULATED_LIMITS, simulated_cards
from gpushare.inspection.dra import dra_cards
from gpushare.inspection.render import (
    render_details,
    render_original_details,
    render_original_summary,
    render_summary,
)
from gpushare.inspection.views import ClusterView, build_cluster
from gpushare.sandbox.controlplane import EXTENDER_USER

DEVICE_CLASS = Path(__file__).resolve().parents[2] / "deploy" / "dra" / "deviceclass.yaml"
# node "mixed": card 0 (80 GiB) offered through DRA, card 1 (15 GiB) through the device plugin
A100, T4 = simulated_cards("mixed", "1xA100-80GB:81920,1xT4:15360")


def inspect(nodes: list[dict], pods: list[dict], slices: list[dict], claims: list[dict[str, Any]]) -> ClusterView:
    return build_cluster(nodes, pods, dra_cards(slices, claims))


def mixed() -> ClusterView:
    nodes = [node("mixed", "10.0.0.1", [T4])]
    pods = [pod("web", "mixed", {"main": mem(4)}, placed(main=[(T4, 4)]))]
    claims = [
        dra_claim("train", "mixed", (0, "8Gi"), users=("trainer",)),
        dra_claim("infer", "mixed", (0, "16Gi"), users=("infer-b", "infer-a")),
    ]
    return inspect(nodes, pods, [resource_slice("mixed", [A100], GIB, 1)], claims)


def test_dra_cards_are_cards_of_their_node_marked_as_such() -> None:
    text = render_summary(mixed())
    assert rows(text)["mixed"] == [
        "mixed",
        "10.0.0.1",
        "GiB",
        "24/80 (DRA)",
        "4/15",
        "28/95 (29%)",
        "A100-80GB (GPU0), T4 (GPU1)",
        "off",
    ]
    assert "Allocated/Total GPU memory in cluster: 28/95 GiB (29%)" in text
    assert "warning" not in text


def test_details_list_each_claim_with_its_pods_and_amount() -> None:
    text = render_details(mixed())
    table = rows(text)
    assert table["NAME"] == ["NAME", "NAMESPACE", "GPU0(Allocated)", "GPU1(Allocated)", "RESERVED FOR"]
    assert table["web"] == ["web", "team", "0", "4"]
    assert table["resourceclaim/infer"] == ["resourceclaim/infer", "team", "16", "0", "pod/infer-a, pod/infer-b"]
    assert table["resourceclaim/train"] == ["resourceclaim/train", "team", "8", "0", "pod/trainer"]
    assert table["Allocated/Total:"] == ["Allocated/Total:", "24/80 (DRA)", "4/15"]
    assert f"LIMITS:     off (GPU0): not reported for cards offered through DRA; off (GPU1): {SIMULATED_LIMITS}" in text
    assert "Allocated:  28 GiB (29%)" in text


def test_the_original_layout_counts_dra_cards_and_lists_their_claims() -> None:
    assert rows(render_original_summary(mixed()))["mixed"] == ["mixed", "10.0.0.1", "24/80", "4/15", "28/95"]
    details = render_original_details(mixed())
    assert rows(details)["resourceclaim/train"] == ["resourceclaim/train", "team", "8", "0"]
    assert "Allocated :  28 (29%)" in details


def test_a_claim_not_reserved_yet_still_holds_its_share() -> None:
    claims = [dra_claim("early", "mixed", (0, "10Gi"))]
    cluster = inspect([node("mixed", "10.0.0.1", [])], [], [resource_slice("mixed", [A100], GIB, 1)], claims)
    assert rows(render_summary(cluster))["mixed"][3] == "10/80 (DRA)"
    assert rows(render_details(cluster))["resourceclaim/early"] == ["resourceclaim/early", "team", "10", "-"]


def test_allocations_over_a_dra_cards_capacity_are_flagged() -> None:
    claims = [dra_claim("a", "mixed", (0, "50Gi")), dra_claim("b", "mixed", (0, "40Gi"))]
    cluster = inspect([node("mixed", "10.0.0.1", [T4])], [], [resource_slice("mixed", [A100], GIB, 1)], claims)
    assert rows(render_summary(cluster))["mixed"][3] == "90/80 (DRA, over-committed)"


def test_a_claim_on_a_device_the_slice_does_not_offer_is_shown() -> None:
    # card 1 left the slice (it became unhealthy) after the claim was allocated on it
    claims = [dra_claim("stuck", "mixed", (1, "2Gi"), users=("old",)), dra_claim("fine", "mixed", (0, "8Gi"))]
    cluster = inspect([node("mixed", "10.0.0.1", [])], [], [resource_slice("mixed", [A100], GIB, 1)], claims)
    text = render_summary(cluster)
    assert rows(text)["mixed"][3] == "8/80 (DRA)"
    assert (
        "warning: node mixed: ResourceClaim team/stuck (pod/old) holds 2 GiB of device card-1, which the node's "
        "ResourceSlice doesn't offer (a card leaves it while unhealthy); not counted on any card"
    ) in text


def test_a_node_with_only_dra_cards_and_no_inventory_is_shown_in_its_slices_unit() -> None:
    half = MemoryUnit(512)
    claims = [dra_claim("c", "dra-only", (0, "3Gi"))]
    cluster = inspect([node("dra-only", "10.0.0.5")], [], [resource_slice("dra-only", [A100], half, 1)], claims)
    assert rows(render_summary(cluster))["dra-only"] == [
        "dra-only",
        "10.0.0.5",
        "512MiB",
        "6/160 (DRA)",
        "6/160 (3%)",
        "A100-80GB",
        "off",
    ]


def test_a_card_offered_both_ways_counts_both_and_is_warned_about() -> None:
    nodes = [node("mixed", "10.0.0.1", [A100, T4])]
    pods = [pod("web", "mixed", {"main": mem(4)}, placed(main=[(A100, 4)]))]
    claims = [dra_claim("train", "mixed", (0, "8Gi"))]
    text = render_summary(inspect(nodes, pods, [resource_slice("mixed", [A100, T4], GIB, 1)], claims))
    assert rows(text)["mixed"][3:5] == ["12/80 (DRA and device plugin)", "0/15 (DRA and device plugin)"]
    assert (
        "warning: node mixed: GPU0, GPU1 offered both through the device plugin (the node's inventory) and through "
        "DRA (its ResourceSlice): the extender counts only pods and the scheduler's DRA allocator only claims"
    ) in text


def test_a_claim_in_a_pool_of_no_node_is_shown() -> None:
    claims = [dra_claim("orphan", "gone", (0, "8Gi"))]
    text = render_summary(inspect([node("mixed", "10.0.0.1", [T4])], [], [], claims))
    assert "warning: ResourceClaim team/orphan holds 8192 MiB of device card-0 in pool gone, which is no node" in text


def test_slices_and_claims_that_cannot_be_read_are_named() -> None:
    bad_slice = resource_slice("mixed", [A100], GIB, 1)
    bad_slice["spec"]["devices"][0]["capacity"]["memory"]["value"] = "lots"
    bad_claim = dra_claim("bad", "mixed", (0, "8Gi"))
    bad_claim["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu0"
    claims = [bad_claim, dra_claim("train", "mixed", (0, "8Gi"))]
    text = render_summary(inspect([node("mixed", "10.0.0.1", [T4])], [], [bad_slice], claims))
    assert (
        "warning: ResourceSlice mixed-gpu.gpushare.io: spec.devices[0].capacity.memory.value: 'lots' is not a "
        "positive whole number of bytes; its cards are not shown"
    ) in text
    assert (
        "warning: ResourceClaim team/bad: status.allocation.devices.results[0].device: device name 'gpu0' is not "
        "card-<NVML index>; the claim is not shown"
    ) in text
    # the card whose slice can't be read is no card, and the claim on it says so
    assert rows(text)["mixed"][3] == "0/15"
    assert "ResourceClaim team/train holds 8 GiB of device card-0, which the node's ResourceSlice" in text


def test_other_drivers_unallocated_claims_and_older_slices_are_left_out() -> None:
    other = dra_claim("nvidia", "mixed", (0, "8Gi"))
    other["status"]["allocation"]["devices"]["results"][0]["driver"] = "gpu.nvidia.com"
    pending = dra_claim("pending", "mixed", (0, "8Gi"))
    del pending["status"]
    older = resource_slice("mixed", [A100, T4], GIB, 1)
    older["metadata"]["name"] = "mixed-old"
    slices = [older, resource_slice("mixed", [A100], GIB, 2)]
    cards = dra_cards(slices, [other, pending])
    assert [c.device for c in cards.offered["mixed"]] == ["card-0"]
    assert cards.shares == () and cards.problems == ()


def test_without_dra_the_tables_are_those_of_the_device_plugin_alone() -> None:
    nodes = [node("mixed", "10.0.0.1", [A100, T4])]
    pods = [pod("web", "mixed", {"main": mem(4)}, placed(main=[(A100, 4)]))]
    for render in (render_summary, render_details, render_original_summary, render_original_details):
        assert render(inspect(nodes, pods, [], [])) == render(build_cluster(nodes, pods))


def test_one_node_shows_only_its_own_dra_cards_and_claims() -> None:
    slices = [resource_slice("mixed", [A100], GIB, 1), resource_slice("other", [A100], GIB, 1)]
    claims = [dra_claim("here", "mixed", (0, "8Gi")), dra_claim("there", "other", (0, "8Gi"))]
    cards = dra_cards(slices, claims).of_node("mixed")
    assert list(cards.offered) == ["mixed"]
    assert [s.name for s in cards.shares] == ["here"]


def test_a_cluster_without_the_dra_api_is_inspected_and_says_why_dra_is_not_shown(
    core_v1: client.CoreV1Api, kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    core_v1.create_node(node("mixed", "10.0.0.1", [T4]))
    core_v1.create_namespaced_pod("team", pod("web", "mixed", {"main": mem(4)}, placed(main=[(T4, 4)])))
    for args in ([], ["-d", "mixed"], ["--layout", "original"]):
        assert main(["inspect", *args, "--kubeconfig", str(kubeconfig)]) == 0
        out, err = capsys.readouterr()
        assert "4/15" in out
        assert err.splitlines() == [
            "gpushare inspect: cards of the DRA driver gpu.gpushare.io not shown: the API server serves no "
            "resource.k8s.io/v1"
        ]


def test_inspect_shows_dra_cards_and_claims_read_from_a_real_api_server(capsys: pytest.CaptureFixture[str]) -> None:
    with real_api_server(rbac=True) as real:
        core, resource = client.CoreV1Api(real.api), client.ResourceV1Api(real.api)
        core.create_namespace({"metadata": {"name": "team"}})
        real.wait_default_service_account("team")
        utils.create_from_yaml(real.api, str(DEVICE_CLASS))
        core.create_node(node("mixed", "10.0.0.1", [T4]))
        web = gpu_pod("web", [container("main", mem=4)], node="mixed", allocation={"main": slices([T4], 4)})
        core.create_namespaced_pod("team", {**web, "metadata": {**web["metadata"], "namespace": "team"}})
        resource.create_resource_slice(resource_slice("mixed", [A100], GIB, 1))
        claims = [
            dra_claim("train", "mixed", (0, "8Gi"), users=("trainer",)),
            dra_claim("big", "mixed", (0, "76Gi")),
            dra_claim("stuck", "mixed", (1, "2Gi")),  # allocated on a card the slice doesn't offer
        ]
        for claim in claims:
            del claim["metadata"]["uid"]
            status = claim.pop("status")
            created = resource.create_namespaced_resource_claim("team", claim)
            body = {**real.api.sanitize_for_serialization(created), "status": status}
            resource.replace_namespaced_resource_claim_status(claim["metadata"]["name"], "team", body)

        assert main(["inspect", "--kubeconfig", str(real.kubeconfig)]) == 0
        out, err = capsys.readouterr()
        assert rows(out)["mixed"][3:6] == ["84/80 (DRA, over-committed)", "4/15", "88/95 (92%)"]
        assert "warning: node mixed: ResourceClaim team/stuck holds 2 GiB of device card-1, which" in out
        assert err == ""

        assert main(["inspect", "-d", "mixed", "--kubeconfig", str(real.kubeconfig)]) == 0
        table = rows(capsys.readouterr().out)
        assert table["resourceclaim/train"] == ["resourceclaim/train", "team", "8", "0", "pod/trainer"]
        assert table["resourceclaim/big"] == ["resourceclaim/big", "team", "76", "0", "-"]
        assert table["web"] == ["web", "team", "0", "4"]

        # the extender's account reads nodes, pods, and the DRA slices and claims it steers DRA pods by
        assert main(["inspect", "--kubeconfig", str(real.kubeconfig_of(EXTENDER_USER))]) == 0
        out, err = capsys.readouterr()
        assert rows(out)["mixed"][3:6] == ["84/80 (DRA, over-committed)", "4/15", "88/95 (92%)"]
        assert err == ""


def test_summary_columns_are_the_cards_indexes_when_a_node_lacks_some() -> None:
    # card 0 of "mixed" is the DRA driver's, so its inventory lists card 1 alone
    nodes = [node("mixed", "10.0.0.1", [T4]), node("full", "10.0.0.2", simulated_cards("full", "2xT4:15360"))]
    table = rows(render_summary(inspect(nodes, [], [], [])))
    assert table["NAME"][3:5] == ["GPU0(Allocated/Total)", "GPU1(Allocated/Total)"]
    assert table["mixed"][3:5] == ["-", "0/15"]
    assert table["full"][3:5] == ["0/15", "0/15"]
