"""Every number read from a pod or a node is bounded where it is parsed (gpushare/contract/units.py):
one too large for the arithmetic it enters is refused with the object and field named."""

from __future__ import annotations

import json

import pytest
from podfactory import container, gpu_pod

from gpushare.cards import Card
from gpushare.contract.aliyun import parse_card_index
from gpushare.contract.allocation import parse_allocation
from gpushare.contract.dra import DraMemoryError, parse_card_memory, parse_memory_bytes
from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import format_inventory, parse_inventory
from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.pending import LedgerError, parse_pending_binds
from gpushare.contract.request import parse_pod_request
from gpushare.contract.units import (
    CARDS_LIMIT,
    GIB,
    HOST_LIMIT,
    UNITS_LIMIT,
    QuantityError,
    parse_host_quantity,
    parse_unit,
)
from gpushare.holdings.node import inferred_inventory

BEYOND = "9" * 30


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1e30", "is more than the 9007199254740992 millicores allowed"), ("-1", "is negative"),
     ("lots", "is not a quantity"), ("1e999999999", "is not a quantity"), (True, "is not a quantity")],
)  # fmt: skip
def test_a_host_quantity_beyond_the_bound_names_the_field(value: object, expected: str) -> None:
    with pytest.raises(QuantityError) as refused:
        parse_host_quantity(value, 1000, "millicores", "pod ns/p container 'main' resources.requests.cpu")
    assert str(refused.value).startswith("pod ns/p container 'main' resources.requests.cpu: ")
    assert str(refused.value).endswith(expected)


def test_host_quantities_within_the_bound_are_read_as_kubernetes_writes_them() -> None:
    assert parse_host_quantity("250m", 1000, "millicores", "w") == 250
    assert parse_host_quantity("2Gi", 1, "bytes", "w") == 2 << 30
    assert parse_host_quantity(HOST_LIMIT, 1, "bytes", "w") == HOST_LIMIT


@pytest.mark.parametrize(("resource", "limit"), [(RESOURCE_MEM, UNITS_LIMIT), (RESOURCE_COUNT, CARDS_LIMIT)])
def test_gpu_requests_beyond_the_bound_name_pod_container_and_resource(resource: str, limit: int) -> None:
    within = gpu_pod("p", [container("main")])
    within["spec"]["containers"][0]["resources"]["limits"] = {resource: str(limit)}
    assert parse_pod_request(within).containers[0].wants_gpu
    for value in (str(limit + 1), BEYOND, "9" * 5000):
        pod = gpu_pod("p", [container("main")])
        pod["spec"]["containers"][0]["resources"]["limits"] = {resource: value}
        with pytest.raises(
            QuantityError, match=f"^pod default/p container main {resource}: .* is more than the {limit}"
        ):
            parse_pod_request(pod)


def test_card_figures_in_annotations_and_node_status_are_bounded() -> None:
    card = Card(index=0, uuid="GPU-0", model="A100", memory_mib=81920, minor=0)
    raw = json.loads(format_inventory([card], GIB))
    raw["cards"][0]["memoryMiB"] = UNITS_LIMIT + 1
    with pytest.raises(ContractError, match=r"card 0 memoryMiB: .* is more than the"):
        parse_inventory(json.dumps(raw), "n1")
    slices = {"main": [{"index": 0, "uuid": "GPU-0", "units": UNITS_LIMIT + 1}]}
    with pytest.raises(ContractError, match=r"container 'main': units on card 0: .* is more than the"):
        parse_allocation(json.dumps(slices), "ns/p")
    with pytest.raises(ContractError, match=r"ALIYUN_COM_GPU_MEM_IDX: .* is more than the"):
        parse_card_index(BEYOND, "ns/p")
    with pytest.raises(LedgerError, match="more than the 4294967296 units allowed"):
        parse_pending_binds(json.dumps({"uid": {"pod": "ns/p", "held": {"GPU-0": UNITS_LIMIT + 1}, "at": 1.0}}), "n1")
    with pytest.raises(ContractError, match=r"memory unit .* is more than the"):
        parse_unit(f"{UNITS_LIMIT + 1}MiB")
    node = {"metadata": {"name": "n1"}, "status": {"allocatable": {RESOURCE_MEM: "80", RESOURCE_COUNT: BEYOND}}}
    with pytest.raises(ContractError, match=f"node n1 status.allocatable.{RESOURCE_COUNT}: .* is more than the"):
        inferred_inventory(node)


@pytest.mark.parametrize("raw", ["1e999999", "9" * 5000])
def test_a_claims_memory_beyond_bytes_a_card_could_have_is_refused_not_computed(raw: str) -> None:
    """A ResourceClaim's consumedCapacity (or a device's capacity) of 1e999999 is refused as a
    quantity, before a million-digit whole number is made of it."""
    with pytest.raises(DraMemoryError, match=r"is more than the 9007199254740992 bytes allowed"):
        parse_memory_bytes(raw)


def test_a_prepared_claims_memory_record_of_thousands_of_digits_is_refused() -> None:
    with pytest.raises(DraMemoryError, match="is not <card UUID>=<positive bytes>"):
        parse_card_memory("GPU-1=" + "9" * 5000, "spec x")
