"""The node's ResourceSlice on a real kube-apiserver: written when missing or when the cards change, left
alone otherwise, and written again after someone (kubelet, at its start) deletes it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from gpushare.advertiser.deviceorder import ORDER_BEST_FIT
from gpushare.advertiser.resourceslice import resource_slice
from gpushare.advertiser.slices import SlicePublisher
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.inspecting import dra_claim
from support.realapi import real_api_server
from support.waiting import wait_until

from gpushare.contract.resourceslice import ResourceSliceError
from gpushare.contract.units import GIB, MemoryUnit
from gpushare.gpus.backend import CardBook
from gpushare.gpus.simulated import SimulatedBackend, simulated_cards

SPEC = "2xA100-80GB:81920,1xT4:15360"
NAME = "n1-gpu.gpushare.io"


@pytest.fixture(scope="module")
def real_api() -> Iterator[client.ApiClient]:
    with real_api_server() as real:
        yield real.api


@pytest.fixture
def resource(real_api: client.ApiClient) -> client.ResourceV1Api:
    """The resource.k8s.io/v1 API, with no ResourceSlice left from an earlier test."""
    api = client.ResourceV1Api(real_api)
    api.delete_collection_resource_slice()
    return api


def live(resource: client.ResourceV1Api) -> dict[str, Any] | None:
    try:
        return resource.api_client.sanitize_for_serialization(resource.read_resource_slice(NAME))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def offered(resource: client.ResourceV1Api) -> list[str]:
    return [d["name"] for d in live(resource)["spec"]["devices"]]


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpushare.advertiser.slices"]


def test_a_node_name_no_slice_can_carry_is_refused_at_once() -> None:
    with pytest.raises(ResourceSliceError, match="too long"):
        SlicePublisher(client.ApiClient(), "n" * 240, CardBook([]), GIB)


def test_the_api_server_accepts_every_shape_of_slice(resource: client.ResourceV1Api) -> None:
    t4 = simulated_cards("n1", "1xT4:15360")[0]
    for node, cards, unit in (
        ("big", simulated_cards("big", "8xA100-80GB:81920"), GIB),
        ("mib", simulated_cards("mib", "2xT4:15109"), MemoryUnit(1)),
        ("odd", simulated_cards("odd", "2xT4:15109"), MemoryUnit(1000)),
        ("one", [replace(t4, memory_mib=1500)], GIB),
        ("none", [], GIB),
    ):
        resource.create_resource_slice(resource_slice(node, cards, unit, 1), dry_run="All")


def test_creates_the_slice_and_leaves_it_alone_while_nothing_changes(
    real_api: client.ApiClient, resource: client.ResourceV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = SlicePublisher(real_api, "n1", SimulatedBackend("n1", SPEC), GIB)
    with caplog.at_level(logging.INFO, logger="gpushare.advertiser.slices"):
        assert publisher.publish_once() is True
    got = live(resource)
    assert got["spec"]["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 1}
    assert got["spec"]["devices"][0]["capacity"]["memory"]["value"] == "80Gi"
    assert logged(caplog) == [
        f"node n1: created ResourceSlice {NAME} (generation 1)",
        *(f"node n1: ResourceSlice {NAME} offers card-{i} (generation 1)" for i in range(3)),
    ]
    assert publisher.publish_once() is False
    assert live(resource)["metadata"]["resourceVersion"] == got["metadata"]["resourceVersion"]


def test_a_card_change_rewrites_the_slice_with_the_next_generation(
    real_api: client.ApiClient, resource: client.ResourceV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    backend = SimulatedBackend("n1", SPEC)
    publisher = SlicePublisher(real_api, "n1", backend, GIB)
    publisher.publish_once()
    backend.inject_xid(backend.cards()[2].uuid, 79)
    with caplog.at_level(logging.INFO, logger="gpushare.advertiser.slices"):
        assert publisher.publish_once() is True
    assert offered(resource) == ["card-0", "card-1"]
    assert live(resource)["spec"]["pool"]["generation"] == 2
    assert logged(caplog) == [f"node n1: ResourceSlice {NAME} no longer offers card-2 (generation 2)"]


def test_a_slice_someone_else_changed_is_put_back(
    real_api: client.ApiClient, resource: client.ResourceV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = SlicePublisher(real_api, "n1", SimulatedBackend("n1", SPEC), GIB)
    publisher.publish_once()
    resource.patch_resource_slice(NAME, {"spec": {"pool": {"resourceSliceCount": 2}}})
    with caplog.at_level(logging.INFO, logger="gpushare.advertiser.slices"):
        assert publisher.publish_once() is True
    assert live(resource)["spec"]["pool"] == {"name": "n1", "generation": 2, "resourceSliceCount": 1}
    assert logged(caplog) == [f"node n1: ResourceSlice {NAME} was rewritten (its spec had been changed) (generation 2)"]


def test_a_new_process_continues_from_the_live_generation(
    real_api: client.ApiClient, resource: client.ResourceV1Api
) -> None:
    SlicePublisher(real_api, "n1", CardBook(simulated_cards("n1", SPEC)), GIB).publish_once()
    restarted = SlicePublisher(real_api, "n1", CardBook(simulated_cards("n1", "1xT4:15360")), GIB)
    assert restarted.publish_once() is True
    assert live(resource)["spec"]["pool"]["generation"] == 2 and offered(resource) == ["card-0"]


def test_the_running_publisher_follows_health_and_recreates_a_deleted_slice(
    real_api: client.ApiClient, resource: client.ResourceV1Api
) -> None:
    backend = SimulatedBackend("n1", SPEC)
    publisher = SlicePublisher(real_api, "n1", backend, GIB, interval=3600)
    publisher.start()
    try:
        wait_until(publisher.ready, 10, "the first publication")
        backend.inject_xid(backend.cards()[0].uuid, 79)
        wait_until(lambda: offered(resource) == ["card-1", "card-2"], 10, "the unhealthy card to leave the slice")
        resource.delete_resource_slice(NAME)  # what kubelet does when it starts
        wait_until(lambda: live(resource), 10, "the slice to be written again")
        assert offered(resource) == ["card-1", "card-2"]
        assert live(resource)["spec"]["pool"]["generation"] == 3
    finally:
        publisher.stop()
    assert not publisher.alive()


def allocate(resource: client.ResourceV1Api, claim: dict[str, Any]) -> None:
    """Create ``claim`` and write its allocation, as kube-scheduler does."""
    del claim["metadata"]["uid"]
    status = claim.pop("status")
    created = resource.api_client.sanitize_for_serialization(resource.create_namespaced_resource_claim("team", claim))
    resource.replace_namespaced_resource_claim_status(claim["metadata"]["name"], "team", {**created, "status": status})


def test_best_fit_lists_the_card_a_claim_holds_first_with_one_write_per_change(
    real_api: client.ApiClient, resource: client.ResourceV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    with contextlib.suppress(ApiException):
        client.CoreV1Api(real_api).create_namespace({"metadata": {"name": "team"}})
    publisher = SlicePublisher(real_api, "n1", SimulatedBackend("n1", SPEC), GIB, interval=3600, order=ORDER_BEST_FIT)
    with caplog.at_level(logging.INFO, logger="gpushare.advertiser.slices"):
        publisher.start()
        try:
            wait_until(publisher.ready, 10, "the first publication")
            assert offered(resource) == ["card-0", "card-1", "card-2"]  # nothing allocated: index order
            first = live(resource)["spec"]["pool"]["generation"]
            allocate(resource, dra_claim("elsewhere", "n2", (0, "70Gi")))  # another node's card orders nothing
            allocate(resource, dra_claim("train", "n1", (1, "8Gi")))
            wait_until(lambda: offered(resource)[0] == "card-1", 10, "card 1, which a claim holds, to come first")
            assert offered(resource) == ["card-1", "card-0", "card-2"]
            assert live(resource)["spec"]["pool"]["generation"] == first + 1
            resource.delete_namespaced_resource_claim("train", "team")  # released: back to index order
            wait_until(lambda: offered(resource)[0] == "card-0", 10, "card 1 to go back to its place")
            assert live(resource)["spec"]["pool"]["generation"] == first + 2
        finally:
            publisher.stop()
            resource.delete_collection_namespaced_resource_claim("team")
    assert f"node n1: ResourceSlice {NAME} lists its devices least free first: card-1, card-0, card-2 " in "\n".join(
        logged(caplog)
    )
