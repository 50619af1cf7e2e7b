from typing import Any

import pytest
from support.draclaims import NODE, REF, claim, result

from gpushare.contract.dra import claim_cdi_devices, format_device_name, parse_device_name
from gpushare.contract.errors import ContractError
from gpushare.contract.resourceclaim import (
    AllocatedShare,
    ClaimError,
    asks_driver,
    claim_allocation,
    driver_requests,
    driver_shares,
)
from gpushare.placement.dra import DeviceAsk


def test_a_share_of_one_card_gives_card_request_share_and_memory() -> None:
    got = claim_allocation(claim(result(device="card-1", memory="8Gi")), REF, NODE)
    assert got.claim == REF
    assert got.shares == (
        AllocatedShare(
            request="gpu",
            device="card-1",
            index=1,
            memory_bytes=8 << 30,
            share_id="dcd38910-fed2-4b80-8171-4063a68fb92f",
        ),
    )


def test_results_of_other_drivers_and_other_nodes_are_left_out() -> None:
    other_driver = {**result(device="gpu-0"), "driver": "gpu.nvidia.com"}
    other_node = result(device="card-1", pool="node-b")
    got = claim_allocation(claim(other_driver, other_node, result(device="card-0")), REF, NODE)
    assert [s.device for s in got.shares] == ["card-0"]


def test_every_node_s_results_of_the_driver_come_with_their_pool() -> None:
    other_driver = {**result(device="gpu-0"), "driver": "gpu.nvidia.com"}
    raw = claim(other_driver, result(device="card-1", pool="node-b"), result(device="card-0"))
    got = driver_shares(raw, "ResourceClaim ns/claim-1")
    assert [(pool, share.device) for pool, share in got] == [("node-b", "card-1"), (NODE, "card-0")]


def test_a_first_available_subrequest_belongs_to_its_request() -> None:
    got = claim_allocation(claim(result(request="gpu/big")), REF, NODE)
    assert got.shares[0].request == "gpu/big"
    assert got.shares[0].base_request == "gpu"


def test_a_result_without_share_id_is_accepted() -> None:
    raw = result()
    del raw["shareID"]
    assert claim_allocation(claim(raw), REF, NODE).shares[0].share_id is None


@pytest.mark.parametrize(
    ("raw", "fault"),
    [
        (claim(uid="another-uid"), "metadata.uid is 'another-uid', the claim was replaced"),
        ({"metadata": {"uid": REF.uid}, "status": {}}, "status.allocation: None is not an object"),
        (claim(result(device="gpu0")), "results[0].device: device name 'gpu0' is not card-<NVML index>"),
        (claim(result(memory="lots")), "results[0].consumedCapacity.memory: 'lots' is not a positive whole"),
        (claim(result(memory="0.5")), "results[0].consumedCapacity.memory: '0.5' is not a positive whole"),
        (claim(result(memory="0")), "results[0].consumedCapacity.memory: '0' is not a positive whole"),
        (claim(result(consumedCapacity={})), "results[0].consumedCapacity.memory: missing"),
        (claim(result(consumedCapacity=None)), "results[0].consumedCapacity: None is not an object"),
        (claim(result(request="")), "results[0].request: '' is not a non-empty string"),
        (claim(result(shareID=7)), "results[0].shareID: 7 is not a non-empty string"),
        (claim(result(pool="node-b")), "has no device of driver gpu.gpushare.io in pool node-a"),
    ],
)
def test_a_malformed_claim_is_refused_naming_the_claim_and_field(raw: dict[str, Any], fault: str) -> None:
    with pytest.raises(ClaimError) as err:
        claim_allocation(raw, REF, NODE)
    assert f"ResourceClaim ns/claim-1 (uid {REF.uid})" in str(err.value)
    assert fault in str(err.value)


def test_device_names_round_trip_and_reject_other_spellings() -> None:
    assert parse_device_name(format_device_name(12)) == 12
    for bad in ("card0", "card-", "card-01", "card--1", "gpu-1", "card-1x"):
        with pytest.raises(ContractError, match="is not card-<NVML index>"):
            parse_device_name(bad)


def test_claim_cdi_devices_are_found_in_the_cri_field_and_in_cdi_annotations_once_each() -> None:
    ours, again = f"gpu.gpushare.io/claim={REF.uid}-gpu", f"gpu.gpushare.io/claim={REF.uid}-big"
    annotations = {
        "cdi.k8s.io/gpu.gpushare.io_claim": f"{again},{ours}",
        "cdi.k8s.io/other": "vendor.example/fpga=0",
        "gpushare.io/cards": "gpu.gpushare.io/claim=not-a-cdi-annotation",
    }
    found = claim_cdi_devices(["nvidia.com/gpu=GPU-aaaa", ours, "gpu.gpushare.io/gpu=0"], annotations)
    assert found == (ours, again)
    assert claim_cdi_devices(["nvidia.com/gpu=GPU-aaaa"], {}) == ()


def claim_spec(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": "c"}, "spec": {"devices": {"requests": list(requests)}}}


def exactly(name: str = "gpu", **fields: Any) -> dict[str, Any]:
    body = {"deviceClassName": "gpu.gpushare.io", "capacity": {"requests": {"memory": "8Gi"}}, **fields}
    return {"name": name, "exactly": body}


def test_a_claim_s_requests_give_count_and_memory_of_each_card() -> None:
    got = driver_requests(claim_spec(exactly(), exactly("two", allocationMode="ExactCount", count=2)), "claim ns/c")
    assert got == (DeviceAsk("gpu", 1, 8 << 30), DeviceAsk("two", 2, 8 << 30))


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({"name": "gpu", "firstAvailable": []}, "not an exactly request (firstAvailable, name)"),
        ({"name": "gpu", "exactly": None}, "spec.devices.requests[0].exactly: None is not an object"),
        (exactly(deviceClassName="gpu.nvidia.com"), "exactly.deviceClassName: 'gpu.nvidia.com'"),
        (exactly(allocationMode="All"), "exactly.allocationMode"),
        (exactly(selectors=[{"cel": {"expression": "true"}}]), "exactly.selectors"),
        (exactly(count=0), "exactly.count"),
        (exactly(capacity={"requests": {}}), "exactly.capacity.requests.memory: missing"),
        (exactly(capacity={"requests": {"memory": "lots"}}), "exactly.capacity.requests.memory: 'lots'"),
    ],
)
def test_a_request_that_can_t_be_predicted_is_named_with_its_field(request_: dict[str, Any], field: str) -> None:
    with pytest.raises(ClaimError, match=r"^claim ns/c: spec\.devices\.requests\[0\]") as err:
        driver_requests(claim_spec(request_), "claim ns/c")
    assert field in str(err.value)


def test_a_claim_asks_the_driver_when_a_request_or_an_alternative_names_its_class() -> None:
    other = exactly(deviceClassName="nic.example.com")
    alternatives = {"name": "gpu", "firstAvailable": [other["exactly"], exactly()["exactly"]]}
    assert asks_driver(claim_spec(other, alternatives))
    assert not asks_driver(claim_spec(other))
    assert not asks_driver({"metadata": {"name": "c"}})
