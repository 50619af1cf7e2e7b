"""``gpushare node --gpus nvml`` on the real cluster: the node agent of node-dgx loads the fake
libnvidia-ml presenting a DGX A100 through pynvml, and the real kubelet takes its devices."""

from __future__ import annotations

from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM
from gpushare.sandbox.realcluster import RealCluster

from .conftest import API_POLL, NVML_NODE, NVML_RECOVERY, Pods, assert_sees_assigned_cards, pod_manifest

CARDS, CARD_GIB = 8, 80


def machine_uuids(cluster: RealCluster) -> list[str]:
    """The card UUIDs the machine description lists, in NVML index order."""
    fake = cluster.nodes[NVML_NODE].fake_nvml
    assert fake is not None
    return [line.split()[1] for line in fake.machine.read_text().splitlines() if line.startswith("uuid ")]


def offered(core: client.CoreV1Api, resource: str) -> tuple[int, int]:
    """The node's (capacity, allocatable) of ``resource`` as kubelet last reported them."""
    status = core.read_node(NVML_NODE).status
    return int((status.capacity or {}).get(resource, "0")), int((status.allocatable or {}).get(resource, "0"))


def test_inventory_and_kubelet_resources_match_the_machine(cluster: RealCluster, core: client.CoreV1Api) -> None:
    inventory = cluster.node_inventory(NVML_NODE)
    assert [card.uuid for card in inventory.cards] == machine_uuids(cluster)
    assert {card.model for card in inventory.cards} == {"NVIDIA A100-SXM4-80GB"}
    assert [inventory.units_of(card) for card in inventory.cards] == [CARD_GIB] * CARDS
    # one gpu-count device per memory unit of each card (--count-replicas 0)
    for resource in (RESOURCE_MEM, RESOURCE_COUNT):
        assert offered(core, resource) == (CARDS * CARD_GIB, CARDS * CARD_GIB), resource


def test_a_gpu_pod_runs_on_the_nvml_node_with_its_card(pods: Pods) -> None:
    name = pods.create(pod_manifest(pods.name("nvml"), ({RESOURCE_MEM: 20},), node=NVML_NODE))
    pods.wait_running(name)
    assert_sees_assigned_cards(pods, name)
    (slices,) = pods.allocation(name).values()
    assert slices[0].uuid in machine_uuids(pods.cluster)


def test_a_critical_xid_takes_the_card_off_kubelet_until_it_recovers(
    cluster: RealCluster, core: client.CoreV1Api
) -> None:
    fake = cluster.nodes[NVML_NODE].fake_nvml
    assert fake is not None
    full = CARDS * CARD_GIB
    wait_until(lambda: offered(core, RESOURCE_MEM)[1] == full, 30, "every card allocatable", API_POLL)
    fake.xid(machine_uuids(cluster)[3], 79)
    # kubelet keeps the unhealthy devices in capacity and drops them from allocatable
    wait_until(
        lambda: offered(core, RESOURCE_MEM) == (full, full - CARD_GIB),
        30,
        "kubelet to report one card fewer allocatable after XID 79",
        API_POLL,
    )
    wait_until(
        lambda: offered(core, RESOURCE_MEM)[1] == full,
        NVML_RECOVERY + 30,
        f"the card to come back once it stayed quiet for {NVML_RECOVERY:g}s",
        API_POLL,
    )
