"""What a pod holds through its ResourceClaims of driver gpu.gpushare.io, and the memory limits that
follow from it, decided without I/O."""

from __future__ import annotations

from typing import Any

import pytest
from support.draclaims import CARDS, NODE, claim, claim_pod, result

from gpushare.contract.inventory import NodeInventory
from gpushare.contract.resourceclaim import ClaimError
from gpushare.contract.units import GIB
from gpushare.holdings.dra import dra_env, dra_held, pod_claim_names
from gpushare.memlimits.policy import pod_limits

A, B = CARDS
INVENTORY = NodeInventory(GIB, CARDS)
POD_UID = "uid-train"


def claims_of(*claims: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in claims}


def test_a_pod_holds_the_sum_of_its_claims_on_each_card_of_this_node() -> None:
    first = claim(result(device="card-0", memory="8Gi"), name="first", uid="u1", reserved_for=[POD_UID])
    second = claim(
        result(device="card-0", memory="4Gi", request="a"),
        result(device="card-1", memory="2Gi", request="b"),
        {**result(device="gpu-0"), "driver": "gpu.nvidia.com"},  # another driver's device adds nothing
        result(device="card-1", memory="16Gi", pool="node-b"),  # nor does another node's card
        name="second",
        uid="u2",
        reserved_for=[POD_UID, "uid-later"],  # the claim is this pod's: it was reserved for it first
    )
    pod = claim_pod("train", POD_UID, ["first", "second"])
    held = dra_held(pod, claims_of(first, second), NODE, INVENTORY)
    assert held == {A.uuid: 12, B.uuid: 2}
    limits = pod_limits(held, CARDS, GIB)
    assert [(limit.uuid, limit.soft_bytes, limit.hard_bytes) for limit in limits] == [
        (A.uuid, 12 << 30, 12 << 30),
        (B.uuid, 2 << 30, 2 << 30),
    ]


def test_a_claim_shared_by_two_pods_is_held_by_the_first_it_was_reserved_for_and_refused_to_the_other() -> None:
    """Each pod's cgroup gets its own limits: two pods given a shared 8 GiB claim would be allowed 16 GiB
    of it. The later pod is refused, naming the pod it waits for, and not counted at a share of it: a
    division would change the running pod's limits whenever a pod joined."""
    shared = claim(result(memory="8Gi"), name="gpu", uid="u1", reserved_for=["uid-first", POD_UID])
    assert dra_held(claim_pod("first", "uid-first", ["gpu"]), {"gpu": shared}, NODE, INVENTORY) == {A.uuid: 8}
    with pytest.raises(ClaimError) as err:
        dra_held(claim_pod("train", POD_UID, ["gpu"]), {"gpu": shared}, NODE, INVENTORY)
    assert str(err.value).startswith(
        "ResourceClaim ns/gpu (uid u1) is in use by pod ns/pod-uid-first (uid uid-first) as well as pod ns/train: "
    )


def test_a_container_sees_every_card_of_the_claims_it_was_given_once_with_the_units_summed() -> None:
    first = claim(result(device="card-1", memory="8Gi"), name="first", uid="u1", reserved_for=[POD_UID])
    second = claim(
        result(device="card-0", memory="4Gi", request="a"),
        result(device="card-1", memory="2Gi", request="a"),
        result(device="card-0", memory="16Gi", request="b"),
        name="second",
        uid="u2",
        reserved_for=[POD_UID],
    )
    pod = claim_pod("train", POD_UID, ["first", "second"])
    devices = ["gpu.gpushare.io/claim=u1-gpu", "gpu.gpushare.io/claim=u2-a"]
    expected = {
        "NVIDIA_VISIBLE_DEVICES": f"{B.uuid},{A.uuid}",
        "ALIYUN_COM_GPU_MEM_IDX": "1,0",
        "ALIYUN_COM_GPU_MEM_POD": "30",
        "ALIYUN_COM_GPU_MEM_CONTAINER": "14",
        "ALIYUN_COM_GPU_MEM_DEV": "80",
    }
    assert dra_env(pod, claims_of(first, second), devices, NODE, INVENTORY) == expected
    # in the pod's order of its claims, whatever kubelet's order of their devices
    assert dra_env(pod, claims_of(first, second), devices[::-1], NODE, INVENTORY) == expected


def test_a_claim_of_other_drivers_only_holds_nothing_here() -> None:
    nic = claim({**result(), "driver": "nic.example.com"}, name="nic", reserved_for=[POD_UID])
    assert dra_held(claim_pod("train", POD_UID, ["nic"]), claims_of(nic), NODE, INVENTORY) == {}


def test_a_claim_of_the_whole_card_gets_no_limit_as_nobody_shares_it() -> None:
    whole = claim(result(memory="80Gi"), name="whole", reserved_for=[POD_UID])
    held = dra_held(claim_pod("train", POD_UID, ["whole"]), claims_of(whole), NODE, INVENTORY)
    assert held == {A.uuid: 80} and pod_limits(held, CARDS, GIB) == ()


def test_the_claim_names_come_from_the_spec_the_status_and_the_extended_resource_claim() -> None:
    pod = claim_pod("train", POD_UID, ["direct", "direct"])
    pod["spec"]["resourceClaims"] += [
        {"name": "from-template", "resourceClaimTemplateName": "gpu-8gi"},
        {"name": "not-needed", "resourceClaimTemplateName": "gpu-8gi"},
    ]
    pod["status"]["resourceClaimStatuses"] = [
        {"name": "from-template", "resourceClaimName": "train-from-template-x7k2p"},
        {"name": "not-needed"},
    ]
    pod["status"]["extendedResourceClaimStatus"] = {"requestMappings": [], "resourceClaimName": "train-extended"}
    assert pod_claim_names(pod) == ("direct", "train-from-template-x7k2p", "train-extended")
    assert pod_claim_names(claim_pod("plain", "uid-plain", [])) == ()


def test_a_template_claim_not_yet_named_in_the_status_is_an_error_naming_pod_and_entry() -> None:
    pod = claim_pod("train", POD_UID, [])
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu-8gi"}]
    with pytest.raises(ClaimError) as err:
        pod_claim_names(pod)
    assert str(err.value) == (
        "pod ns/train spec.resourceClaims[0] ('gpu'): status.resourceClaimStatuses names no ResourceClaim made "
        "for it yet"
    )


@pytest.mark.parametrize(
    ("raw", "fault"),
    [
        (claim(result(), name="gpu", uid="u1"), "ResourceClaim ns/gpu (uid u1): status.reservedFor does not name pod "),
        (
            claim(result(device="card-7"), name="gpu", uid="u1", reserved_for=[POD_UID]),
            "ResourceClaim ns/gpu (uid u1): request gpu device card-7: no card with index 7 on this node",
        ),
        (
            claim(result(memory="1500Mi"), name="gpu", uid="u1", reserved_for=[POD_UID]),
            "is not a whole number of 1024 MiB units",
        ),
        (
            {"metadata": {"name": "gpu", "uid": "u1"}, "status": {"reservedFor": [{"uid": POD_UID}]}},
            "ResourceClaim ns/gpu (uid u1): status.allocation: None is not an object",
        ),
    ],
    ids=["not-reserved-for-the-pod", "card-not-on-node", "partial-unit", "not-allocated"],
)
def test_a_claim_that_cant_be_counted_is_an_error_naming_it(raw: dict[str, Any], fault: str) -> None:
    with pytest.raises(ClaimError) as err:
        dra_held(claim_pod("train", POD_UID, ["gpu"]), {"gpu": raw}, NODE, INVENTORY)
    assert fault in str(err.value)
