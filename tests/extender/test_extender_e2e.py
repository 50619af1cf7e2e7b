"""End to end through the API stand-in: the advertiser publishes the cards, kube-scheduler's calls go to
the extender over HTTP, and the kubelet emulator admits the bound pod through the real device plugin.
Every container must end up on the cards the scheduler chose."""

from __future__ import annotations

from collections.abc import Callable

from podfactory import container, gpu_pod
from support.extender import AdmittingCluster

from gpushare.contract.allocation import parse_allocation
from gpushare.contract.names import ANN_ALLOCATION, ENV_VISIBLE_DEVICES, RESOURCE_COUNT


def cards_of(bound: dict) -> dict[str, list[str]]:
    allocation = parse_allocation(bound["metadata"]["annotations"][ANN_ALLOCATION])
    return {name: [s.uuid for s in slices] for name, slices in allocation.items()}


def test_each_container_runs_on_the_cards_the_scheduler_chose(
    admitting_cluster: Callable[..., AdmittingCluster],
) -> None:
    cluster = admitting_cluster()
    pods = [
        gpu_pod("single", [container("main", 20)]),
        gpu_pod("pair", [container("worker", 16, 2)]),
        gpu_pod("sidecars", [container("model", 6), container("tokenizer", 2)], init=[container("warm", 1)]),
        gpu_pod("whole", [container("main", 0, 1)]),
        gpu_pod("twins-1", [container("main", 5)]),
        gpu_pod("twins-2", [container("main", 5)]),
    ]
    for pod in pods:
        bound, envs = cluster.run(pod)
        chosen = cards_of(bound)
        assert set(envs) == set(chosen)
        for name, uuids in chosen.items():
            assert envs[name][ENV_VISIBLE_DEVICES].split(",") == uuids, (pod["metadata"]["name"], name)


def test_four_two_card_sharing_pods_fit_a_three_card_node_beside_a_whole_card_pod(
    admitting_cluster: Callable[..., AdmittingCluster],
) -> None:
    cl = admitting_cluster({"gpu-c": "3xA100-80GB:81920"})
    _, envs = cl.run(gpu_pod("whole", [container("main", 0, 1)]))
    whole = envs["main"][ENV_VISIBLE_DEVICES]
    for i in range(4):
        bound, envs = cl.run(gpu_pod(f"pair-{i}", [container("main", 8, 2)]))
        cards = envs["main"][ENV_VISIBLE_DEVICES].split(",")
        assert cards == cards_of(bound)["main"]
        assert len(set(cards)) == 2 and whole not in cards, (i, cards, whole)
    # kubelet counts what kube-scheduler counts: five pods hold 9 of the node's gpu-count replicas
    kubelet = cl.kubelets["gpu-c"]
    assert kubelet.capacity(RESOURCE_COUNT) == 240
    assert sum(len(ids) for ids in kubelet.allocations(RESOURCE_COUNT).values()) == 9
    # a whole-card pod needs an empty card: the shared ones are not, and the whole one is taken
    refused = cl.schedule(gpu_pod("another-whole", [container("main", 0, 1)]))
    assert refused.node is None
    assert refused.reason == "0/1 nodes are available: 1 needs a whole free card, 0 completely free (3 cards)."
