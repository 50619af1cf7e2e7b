"""The DRA driver gpu.gpushare.io on the real cluster: the claims of deploy/examples/dra placed by a
kube-scheduler with no extender in its configuration, prepared by the node agent's kubelet plugin and
applied by containerd as CDI edits; and a node whose cards are split between DRA and the device
plugin, each card filled one way and never past its memory."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, utils
from support.waiting import wait_until

from gpushare.cards import Card
from gpushare.contract.dra import parse_device_name
from gpushare.contract.names import (
    DRA_CAPACITY_MEMORY,
    DRA_DRIVER,
    ENV_MEM_CONTAINER,
    ENV_MEM_IDX,
    ENV_VISIBLE_DEVICES,
    RESOURCE_MEM,
)
from gpushare.gpus.simulated import simulated_cards
from gpushare.kube.objects import get_resource_claim
from gpushare.sandbox.realcluster import RealCluster, as_sandbox_pod

from .conftest import API_POLL, DRA_NODE, MIXED_NODE, MIXED_TAINT, NODES, PLAIN_SCHEDULER, Pods, pod_manifest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLES = DEPLOY / "examples" / "dra"
GIB = 1 << 30
#: each example's pod, and the containers that use its claim
EXAMPLE_PODS = {
    "memory-8gi": ("dra-memory-8gi", ("main",)),
    "shared-claim": ("dra-shared-claim", ("trainer", "evaluator")),
    "nvlink-pair": ("dra-nvlink-pair", ("main",)),
    "a100-only": ("dra-a100-only", ("main",)),
}


def node_cards(node: str) -> dict[int, Card]:
    """The cards the node really has (its simulated spec), by index."""
    spec = dict(NODES)[node]
    return {c.index: c for c in simulated_cards(node, spec.removeprefix("sim:"))}


def claim_shares(claim: Mapping[str, Any]) -> list[tuple[str, Card, int]]:
    """(node, card, GiB) of each share the scheduler allocated to ``claim``."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    shares = []
    for r in results:
        assert r["driver"] == DRA_DRIVER, r
        card = node_cards(r["pool"])[parse_device_name(r["device"])]
        shares.append((r["pool"], card, int(utils.parse_quantity(r["consumedCapacity"][DRA_CAPACITY_MEMORY])) // GIB))
    return shares


class Claims:
    """Creates ResourceClaims, templates and their pods, and deletes them all when the test ends."""

    def __init__(self, cluster: RealCluster, pods: Pods) -> None:
        self.cluster = cluster
        self.pods = pods
        self.resource = client.ResourceV1Api(cluster.api)
        self.made: list[tuple[str, str]] = []

    def apply(self, doc: Mapping[str, Any], scheduler: str = PLAIN_SCHEDULER) -> None:
        if doc["kind"] == "Pod":
            pod = as_sandbox_pod(doc)
            pod["spec"]["schedulerName"] = scheduler
            self.pods.create(pod)
            return
        utils.create_from_dict(self.cluster.api, dict(doc))
        self.made.append((doc["kind"], doc["metadata"]["name"]))

    def claim(self, name: str, memory: str, cel: str | None = None) -> dict[str, Any]:
        exactly: dict[str, Any] = {"deviceClassName": DRA_DRIVER, "capacity": {"requests": {"memory": memory}}}
        if cel:
            exactly["selectors"] = [{"cel": {"expression": cel}}]
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        }

    def claimed_pod(self, name: str, claim: str, node: str | None = None) -> dict[str, Any]:
        pod = pod_manifest(name, ({},), node=node)
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        return pod

    def of_pod(self, pod: str) -> dict[str, Any]:
        """The claim a pod's first claim entry names (made from a template or named directly)."""
        got = self.pods.get(pod)
        (entry, *_) = got["spec"]["resourceClaims"]
        name = entry.get("resourceClaimName")
        for status in (got.get("status") or {}).get("resourceClaimStatuses") or []:
            if status["name"] == entry["name"]:
                name = status["resourceClaimName"]
        assert name, f"pod {pod} has no ResourceClaim yet"
        return get_resource_claim(self.cluster.api, "default", name)

    def delete_all(self) -> None:
        self.pods.delete_all()
        for kind, name in reversed(self.made):
            delete = {
                "ResourceClaim": self.resource.delete_namespaced_resource_claim,
                "ResourceClaimTemplate": self.resource.delete_namespaced_resource_claim_template,
            }[kind]
            delete(name, "default")
        self.made.clear()


@pytest.fixture(scope="module")
def device_class(cluster: RealCluster) -> Iterator[None]:
    resource = client.ResourceV1Api(cluster.api)
    utils.create_from_dict(cluster.api, yaml.safe_load((DEPLOY / "dra" / "deviceclass.yaml").read_text()))
    try:
        yield
    finally:
        resource.delete_device_class(DRA_DRIVER)


@pytest.fixture(scope="module")
def examples(cluster: RealCluster, core: client.CoreV1Api, device_class: None) -> Iterator[Claims]:
    made = Claims(cluster, Pods(cluster, core))
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            made.apply(doc)
    try:
        yield made
    finally:
        made.delete_all()


@pytest.fixture
def claims(cluster: RealCluster, core: client.CoreV1Api, device_class: None) -> Iterator[Claims]:
    made = Claims(cluster, Pods(cluster, core))
    try:
        yield made
    finally:
        made.delete_all()


def assert_sees_claimed_cards(claims: Claims, pod: str, containers: tuple[str, ...]) -> list[tuple[str, Card, int]]:
    """Each container sees exactly the cards, and the memory, the scheduler allocated to the pod's claim."""
    shares = claim_shares(claims.of_pod(pod))
    assert shares, f"pod {pod}'s claim is not allocated"
    node = claims.pods.get(pod)["spec"]["nodeName"]
    assert {n for n, _, _ in shares} == {node}
    for container in containers:
        env = claims.pods.env(pod, container)
        assert env[ENV_VISIBLE_DEVICES].split(",") == [card.uuid for _, card, _ in shares], (pod, container, env)
        assert env[ENV_MEM_IDX].split(",") == [str(card.index) for _, card, _ in shares]
        assert int(env[ENV_MEM_CONTAINER]) == sum(gib for _, _, gib in shares)
    return shares


@pytest.mark.parametrize("example", sorted(EXAMPLE_PODS))
def test_each_example_runs_with_exactly_the_cards_its_claim_was_allocated(examples: Claims, example: str) -> None:
    pod, containers = EXAMPLE_PODS[example]
    examples.pods.wait_running(pod)
    shares = assert_sees_claimed_cards(examples, pod, containers)
    assert {node for node, _, _ in shares} == {DRA_NODE}  # the only untainted node with DRA cards
    cards = [card for _, card, _ in shares]
    if example == "nvlink-pair":
        assert len({c.uuid for c in cards}) == 2 and cards[1].uuid in cards[0].nvlink_peers
    if example == "a100-only":
        assert all("A100" in c.model for c in cards)
    if example == "memory-8gi":
        assert [gib for _, _, gib in shares] == [8]


def test_the_examples_never_fill_a_card_past_its_memory(examples: Claims) -> None:
    held: dict[tuple[str, int], int] = {}
    for pod, _ in EXAMPLE_PODS.values():
        examples.pods.wait_running(pod)
        for node, card, gib in claim_shares(examples.of_pod(pod)):
            held[(node, card.index)] = held.get((node, card.index), 0) + gib
    for (node, index), gib in held.items():
        assert gib * 1024 <= node_cards(node)[index].memory_mib, (node, index, gib)


def unschedulable_message(pods: Pods, name: str) -> str | None:
    for cond in (pods.get(name).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
            return str(cond.get("message", ""))
    return None


def test_a_claim_no_card_can_hold_stays_pending_with_the_schedulers_reason(claims: Claims) -> None:
    claims.apply(claims.claim("too-big", "100Gi"))
    claims.apply(claims.claimed_pod("dra-too-big", "too-big"))
    message = wait_until(
        lambda: unschedulable_message(claims.pods, "dra-too-big"), 30, "dra-too-big to be Unschedulable", API_POLL
    )
    assert "cannot allocate all claims" in message, message
    assert claims.pods.phase("dra-too-big") == "Pending"
    assert "allocation" not in (get_resource_claim(claims.cluster.api, "default", "too-big").get("status") or {})


def held_gib(claims: Claims, node: str, card: Card) -> int:
    """What every ResourceClaim in the cluster was allocated on ``card`` of ``node``, in GiB."""
    listed = claims.resource.list_resource_claim_for_all_namespaces(_preload_content=False)
    return sum(
        gib
        for raw in json.loads(listed.data)["items"]
        for pool, share, gib in claim_shares(raw)
        if (pool, share.uuid) == (node, card.uuid)
    )


def create_container_error(pods: Pods, name: str) -> str | None:
    """Why kubelet can't create the pod's container (the runtime's answer), while it can't."""
    for status in (pods.get(name).get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CreateContainerError":
            return str(waiting.get("message", ""))
    return None


def test_a_claim_shared_by_two_pods_serves_the_first_and_the_card_is_never_promised_twice(claims: Claims) -> None:
    """Two pods naming one claim would each be allowed its whole memory (each pod's cgroup is limited on
    its own), so a claim filling the rest of the card would over-commit it: the second pod is refused."""
    card = node_cards(DRA_NODE)[0]
    on_card = f'device.attributes["{DRA_DRIVER}"].uuid == "{card.uuid}"'
    claims.apply(claims.claim("shared-8", "8Gi", on_card))
    claims.apply(claims.claimed_pod("dra-share-a", "shared-8", node=DRA_NODE))
    claims.pods.wait_running("dra-share-a")
    claims.apply(claims.claimed_pod("dra-share-b", "shared-8", node=DRA_NODE))
    why = wait_until(
        lambda: create_container_error(claims.pods, "dra-share-b"), 60, "dra-share-b to be refused", API_POLL
    )
    assert "ResourceClaim default/shared-8" in why and "is in use by pod default/dra-share-a" in why, why
    assert "pod default/dra-share-b container main" in why, why

    rest = card.memory_mib // 1024 - held_gib(claims, DRA_NODE, card)
    assert rest > 0, f"card {card.uuid} of {DRA_NODE} is full already"
    claims.apply(claims.claim("the-rest", f"{rest}Gi", on_card))
    claims.apply(claims.claimed_pod("dra-the-rest", "the-rest", node=DRA_NODE))
    claims.pods.wait_running("dra-the-rest")
    assert assert_sees_claimed_cards(claims, "dra-the-rest", ("main",)) == [(DRA_NODE, card, rest)]
    assert claims.pods.env("dra-share-a")[ENV_MEM_CONTAINER] == "8"
    assert create_container_error(claims.pods, "dra-share-b"), "the second pod on the shared claim got a container"


def test_a_container_with_two_claims_sees_both_cards_with_the_sums(claims: Claims) -> None:
    """Each claim's CDI spec speaks for its own cards only; the container sees all of them."""
    cards = node_cards(DRA_NODE)
    for i, gib in ((0, 2), (1, 3)):
        claims.apply(claims.claim(f"two-{i}", f"{gib}Gi", f'device.attributes["{DRA_DRIVER}"].index == {i}'))
    pod = claims.claimed_pod("dra-two-claims", "two-0", node=DRA_NODE)
    pod["spec"]["resourceClaims"] = [{"name": f"c{i}", "resourceClaimName": f"two-{i}"} for i in (0, 1)]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "c0"}, {"name": "c1"}]}
    claims.apply(pod)
    claims.pods.wait_running("dra-two-claims")
    env = claims.pods.env("dra-two-claims")
    assert env[ENV_VISIBLE_DEVICES] == f"{cards[0].uuid},{cards[1].uuid}", env
    assert (env[ENV_MEM_IDX], env[ENV_MEM_CONTAINER]) == ("0,1", "5"), env


def test_both_ways_share_a_node_without_double_booking(claims: Claims) -> None:
    plugin_card, dra_card = node_cards(MIXED_NODE)[0], node_cards(MIXED_NODE)[1]
    node = client.CoreV1Api(claims.cluster.api).read_node(MIXED_NODE)
    assert node.status.allocatable[RESOURCE_MEM] == "40", "only card 0 is offered through the device plugin"

    whole = claims.pods.create(pod_manifest("plugin-40", ({RESOURCE_MEM: 40},), node=MIXED_NODE))
    on_dra_card = f'device.attributes["{DRA_DRIVER}"].uuid == "{dra_card.uuid}"'
    claims.apply(claims.claim("mixed-30", "30Gi", on_dra_card))
    tolerated = claims.claimed_pod("dra-30", "mixed-30", node=MIXED_NODE)
    assert tolerated["spec"]["tolerations"] == [MIXED_TAINT]
    claims.apply(tolerated)

    claims.pods.wait_running(whole)
    env = claims.pods.env(whole)
    assert env[ENV_VISIBLE_DEVICES] == plugin_card.uuid
    claims.pods.wait_running("dra-30")
    assert assert_sees_claimed_cards(claims, "dra-30", ("main",)) == [(MIXED_NODE, dra_card, 30)]

    # card 0 is full and card 1 is not the device plugin's; card 1 has 10 GiB left for DRA
    claims.pods.create(pod_manifest("plugin-8", ({RESOURCE_MEM: 8},), node=MIXED_NODE))
    claims.apply(claims.claim("mixed-30-more", "30Gi", on_dra_card))
    claims.apply(claims.claimed_pod("dra-30-more", "mixed-30-more", node=MIXED_NODE))
    for pending in ("plugin-8", "dra-30-more"):
        why = f"{pending} to be Unschedulable"
        wait_until(lambda p=pending: unschedulable_message(claims.pods, p), 30, why, API_POLL)
        assert claims.pods.phase(pending) == "Pending"
