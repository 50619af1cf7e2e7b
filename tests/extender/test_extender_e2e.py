"""End to end through the API stand-in: the advertiser publishes the cards, kube-scheduler's calls go to
the extender over HTTP, and the kubelet emulator admits the bound pod through the real device plugin.
Every container must end up on the cards the scheduler chose."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import wait_until
from gpushare.advertiser.agent import Advertiser
from gpushare.deviceplugin.wiring import start_device_plugin
from gpushare.extender.wiring import start_extender
from kubernetes import client
from podfactory import container, gpu_pod

from gpushare.contract.allocation import parse_allocation
from gpushare.contract.names import ANN_ALLOCATION, ENV_VISIBLE_DEVICES, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.kube.objects import get_pod
from gpushare.sandbox.kubelet import KubeletEmulator
from gpushare.sandbox.scheduler import ExtenderClient, ScheduleResult, schedule_one
from gpushare.settings import NodeSettings

NODES = {"gpu-a": "2xA100-80GB:81920,1xT4:15360", "gpu-b": "1xA10:24576"}


class Cluster:
    def __init__(
        self, api: client.ApiClient, core: client.CoreV1Api, kubeconfig: Path, tmp: Path, nodes: dict[str, str] = NODES
    ) -> None:
        self.api, self.core, self.nodes = api, core, nodes
        self.kubelets: dict[str, KubeletEmulator] = {}
        self.stops: list[Callable[[], None]] = []
        for name, spec in nodes.items():
            core.create_node({"metadata": {"name": name}})
            backend = SimulatedBackend(name, spec)
            advertiser = Advertiser(api, name, backend, GIB, interval=3600)
            advertiser.start()
            self.stops.append(advertiser.stop)
            assert advertiser.published.wait(5)
            kubelet = KubeletEmulator(tmp / name)
            kubelet.start()
            self.stops.append(kubelet.stop)
            settings = NodeSettings(name, str(kubeconfig), f"sim:{spec}", tmp / name, GIB, frozenset())
            plugin = start_device_plugin(settings, backend, api)
            self.stops.insert(0, plugin.stop)
            assert kubelet.wait_for(lambda k: k.registered(RESOURCE_MEM) and k.registered(RESOURCE_COUNT), 10)
            self.kubelets[name] = kubelet
        extender = start_extender(api, 0, "fgd", host="127.0.0.1")
        self.stops.insert(0, extender.stop)
        assert extender.cache.wait_synced(5)
        wait_until(lambda: all(extender.cache.view(n) for n in nodes), what="the advertised inventories")
        self.scheduler = ExtenderClient(f"http://127.0.0.1:{extender.server.port}")

    def schedule(self, pod: dict) -> ScheduleResult:
        """Create ``pod`` unbound and make kube-scheduler's calls to the extender for it."""
        pod = {**pod, "spec": {k: v for k, v in pod["spec"].items() if k != "nodeName"}}
        self.core.create_namespaced_pod("default", pod)
        pending = get_pod(self.api, "default", pod["metadata"]["name"])
        return schedule_one(self.scheduler, pending, sorted(self.nodes))

    def run(self, pod: dict) -> tuple[dict, dict[str, dict[str, str]]]:
        """Schedule ``pod`` as kube-scheduler would, then admit it on its node; the bound pod and each
        container's env from Allocate."""
        result = self.schedule(pod)
        assert result.node, result.reason
        bound = get_pod(self.api, "default", pod["metadata"]["name"])
        admission = self.kubelets[result.node].admit(bound)
        assert admission.admitted, admission.error
        return bound, {name: out.envs for name, out in admission.containers.items()}


@pytest.fixture
def cluster(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api, kubeconfig: Path, tmp_path: Path
) -> Iterator[Cluster]:
    # unix socket paths must stay short, so the device-plugin directories live right under tmp_path
    cl = Cluster(kube_api, core_v1, kubeconfig, tmp_path)
    yield cl
    for stop in cl.stops:
        stop()


def cards_of(bound: dict) -> dict[str, list[str]]:
    allocation = parse_allocation(bound["metadata"]["annotations"][ANN_ALLOCATION])
    return {name: [s.uuid for s in slices] for name, slices in allocation.items()}


def test_each_container_runs_on_the_cards_the_scheduler_chose(cluster: Cluster) -> None:
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
    kube_api: client.ApiClient, core_v1: client.CoreV1Api, kubeconfig: Path, tmp_path: Path
) -> None:
    cl = Cluster(kube_api, core_v1, kubeconfig, tmp_path, nodes={"gpu-c": "3xA100-80GB:81920"})
    try:
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
    finally:
        for stop in cl.stops:
            stop()
