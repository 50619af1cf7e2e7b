"""The DRA manifests (deploy/dra/ and the examples in deploy/examples/dra/) are valid for Kubernetes 1.37,
ask for what the node's ResourceSlice offers, and are accepted by a real kube-apiserver, which also
compiles their CEL."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from gpushare.advertiser.resourceslice import resource_slice
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.realapi import dra_api_server

from gpushare.contract.names import DRA_CAPACITY_MEMORY, DRA_DRIVER
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
#: resource.k8s.io/v1 is served from 1.34; consumable capacity is on by default from 1.36
KUBERNETES_VERSION = "1.37"
MANIFESTS = sorted([*DEPLOY.glob("dra/*.yaml"), *DEPLOY.glob("examples/dra/*.yaml")])
#: every attribute a card's device can carry (a slice of cards with NUMA nodes and NVLink peers)
ATTRIBUTES = {
    name
    for device in resource_slice("n", simulated_cards("n", "4xA100:81920"), GIB, 1)["spec"]["devices"]
    for name in device["attributes"]
}
CEL_ATTRIBUTE = re.compile(r'device\.attributes\["([^"]+)"\]\.(\w+)')


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def claim_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["kind"] == "ResourceClaimTemplate":
                yield f"{path.name}: {doc['metadata']['name']}", doc["spec"]["spec"]


def test_the_device_class_and_each_kind_of_example_are_there() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in MANIFESTS}
    assert names == {
        "dra/deviceclass.yaml",
        "examples/dra/memory-8gi.yaml",
        "examples/dra/shared-claim.yaml",
        "examples/dra/nvlink-pair.yaml",
        "examples/dra/a100-only.yaml",
    }


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_manifest_is_valid_for_kubernetes(path: Path) -> None:
    for doc in documents(path):
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


def test_the_validator_knows_the_claims_capacity_field() -> None:
    """Strict mode catches a misspelt field of resource.k8s.io/v1 too."""
    (template,) = [d for d in documents(DEPLOY / "examples/dra/memory-8gi.yaml") if d["kind"] != "Pod"]
    request = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    request["capacities"] = request.pop("capacity")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)


def test_claims_ask_for_the_drivers_memory_and_attributes() -> None:
    for where, spec in claim_specs():
        for request in spec["devices"]["requests"]:
            exactly = request["exactly"]
            assert exactly["deviceClassName"] == DRA_DRIVER, where
            assert set(exactly["capacity"]["requests"]) == {DRA_CAPACITY_MEMORY}, where
            for selector in exactly.get("selectors") or []:
                for domain, name in CEL_ATTRIBUTE.findall(selector["cel"]["expression"]):
                    assert (domain, name in ATTRIBUTES) == (DRA_DRIVER, True), f"{where}: {domain}/{name}"
        for constraint in spec["devices"].get("constraints") or []:
            for key in ("matchAttribute", "distinctAttribute"):
                if key in constraint:
                    domain, _, name = constraint[key].partition("/")
                    assert (domain, name in ATTRIBUTES) == (DRA_DRIVER, True), f"{where}: {constraint[key]}"


@pytest.fixture(scope="module")
def real_api() -> Iterator[client.ApiClient]:
    with dra_api_server() as api:
        yield api


def dry_run(api: client.ApiClient, doc: dict[str, Any]) -> None:
    if doc["kind"] == "Pod":
        client.CoreV1Api(api).create_namespaced_pod(doc["metadata"]["namespace"], doc, dry_run="All")
    else:
        client.ResourceV1Api(api).create_namespaced_resource_claim_template(
            doc["metadata"]["namespace"], doc, dry_run="All"
        )


@pytest.mark.parametrize("path", MANIFESTS[1:], ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_the_api_server_accepts_the_example(real_api: client.ApiClient, path: Path) -> None:
    for doc in documents(path):
        dry_run(real_api, doc)


def test_the_api_server_refuses_a_selector_that_does_not_compile(real_api: client.ApiClient) -> None:
    (template,) = [d for d in documents(DEPLOY / "examples/dra/a100-only.yaml") if d["kind"] != "Pod"]
    selector = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]
    selector["expression"] = selector["expression"].replace(".contains(", ".contain(")
    with pytest.raises(ApiException) as err:
        dry_run(real_api, template)
    assert err.value.status == 422 and "contain" in err.value.body
