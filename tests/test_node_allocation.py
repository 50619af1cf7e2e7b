"""The device plugin end to end: real gRPC over unix sockets, the kubelet emulator on the other side,
and pod state in the API stand-in reached through the official client."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until
from kubernetes import client
from podfactory import container, gpu_pod, slices

from deviceplugin.runtime import RunningPlugin, start_device_plugin
from gpushare import contract as c
from gpushare.cli import NodeSettings
from gpushare.inventory import SimulatedBackend
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubelet import KubeletEmulator

SPEC = "2xA100-80GB:81920,1xT4:15360"


class Node:
    """One simulated node: cards, kubelet emulator and a running device plugin."""

    def __init__(self, api: client.ApiClient, directory: Path) -> None:
        self.api = api
        self.dir = directory
        self.backend = SimulatedBackend("n1", SPEC)
        self.cards = self.backend.cards()
        self.kubelet = KubeletEmulator(directory)
        self.kubelet.start()
        self.plugin: RunningPlugin | None = None
        self.start_plugin()

    def start_plugin(self) -> None:
        settings = NodeSettings("n1", None, f"sim:{SPEC}", self.dir, c.GIB, frozenset())
        self.plugin = start_device_plugin(settings, self.backend, self.api)
        assert self.kubelet.wait_for(
            lambda k: k.capacity(c.RESOURCE_MEM) == 175 and k.capacity(c.RESOURCE_COUNT) == 3, 5
        ), "plugin did not register both resources"
        assert self.plugin.cache.wait_synced(5)

    def stop(self) -> None:
        if self.plugin:
            self.plugin.stop()
        self.kubelet.stop()

    def create(self, core: client.CoreV1Api, pod: dict) -> dict:
        created = core.create_namespaced_pod("default", pod)
        name = created.metadata.name
        wait_until(lambda: self.plugin.cache.get(name, "default"), what=f"pod {name} in the node cache")
        return self.plugin.cache.get(name, "default")

    def admit(self, core: client.CoreV1Api, pod: dict):
        return self.kubelet.admit(self.create(core, pod))


@pytest.fixture
def node(kube_api: client.ApiClient) -> Iterator[Node]:
    directory = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))  # unix socket paths must stay short
    n = Node(kube_api, directory)
    yield n
    n.stop()
    shutil.rmtree(directory, ignore_errors=True)


def visible(admission, name: str = "main") -> str:
    assert admission.admitted, admission.error
    return admission.containers[name].envs[c.ENV_VISIBLE_DEVICES]


def annotations(core: client.CoreV1Api, name: str) -> dict[str, str]:
    return core.read_namespaced_pod(name, "default").metadata.annotations or {}


def test_listandwatch_lists_each_card_in_its_own_units(node: Node) -> None:
    mem = node.kubelet.devices(c.RESOURCE_MEM)
    per_card = {card.uuid: sum(1 for d in mem if d.startswith(card.uuid)) for card in node.cards}
    assert per_card == {node.cards[0].uuid: 80, node.cards[1].uuid: 80, node.cards[2].uuid: 15}
    assert set(node.kubelet.devices(c.RESOURCE_COUNT)) == {card.uuid for card in node.cards}
    assert node.kubelet.plugin_options(c.RESOURCE_COUNT).get_preferred_allocation_available


def test_equal_requests_each_get_their_own_card(node: Node, core_v1: client.CoreV1Api) -> None:
    a0, a1, _ = node.cards
    # the later-assumed pod is created first: creation order must not decide
    late = gpu_pod("late", [container("main", 8)], allocation={"main": slices([a0], 8)}, assume_ns=2000)
    early = gpu_pod("early", [container("main", 8)], allocation={"main": slices([a1], 8)}, assume_ns=1000)
    node.create(core_v1, late)
    node.create(core_v1, early)
    first = node.kubelet.admit(node.plugin.cache.get("early", "default"))
    second = node.kubelet.admit(node.plugin.cache.get("late", "default"))
    assert visible(first) == a1.uuid and visible(second) == a0.uuid
    ann = annotations(core_v1, "early")
    assert ann[c.ANN_MEM_ASSIGNED] == "true"
    assert first.containers["main"].annotations[c.CTR_ANN_POD] == "default/early"
    assert first.containers["main"].envs[c.ENV_MEM_DEV] == "80"


def test_multi_container_and_init_containers_each_get_their_card(node: Node, core_v1: client.CoreV1Api) -> None:
    a0, a1, t4 = node.cards
    pod = gpu_pod(
        "multi",
        [container("one", 4), container("two", 4), container("side")],
        init=[container("setup", 2)],
        allocation={"setup": slices([t4], 2), "one": slices([a0], 4), "two": slices([a1], 4)},
    )
    admission = node.admit(core_v1, pod)
    assert [visible(admission, n) for n in ("setup", "one", "two")] == [t4.uuid, a0.uuid, a1.uuid]
    assert "side" not in admission.containers
    assert annotations(core_v1, "multi")[c.ANN_MEM_ASSIGNED] == "true"


def test_two_card_container_gets_both_cards_through_both_resources(node: Node, core_v1: client.CoreV1Api) -> None:
    a0, a1, _ = node.cards
    pod = gpu_pod("pair", [container("main", 40, 2)], allocation={"main": slices([a0, a1], 20)})
    admission = node.admit(core_v1, pod)
    assert visible(admission) == f"{a0.uuid},{a1.uuid}"
    # kubelet followed the preferred allocation for gpu-count: the scheduler's two cards
    assert sorted(admission.containers["main"].device_ids[c.RESOURCE_COUNT]) == sorted([a0.uuid, a1.uuid])
    served = c.parse_assigned_containers(annotations(core_v1, "pair")[c.ANN_ASSIGNED_CONTAINERS])
    assert served == {"main": frozenset({c.RESOURCE_MEM, c.RESOURCE_COUNT})}


def test_pod_with_only_the_original_annotations(node: Node, core_v1: client.CoreV1Api) -> None:
    admission = node.admit(core_v1, gpu_pod("legacy", [container("main", 6)], original_index=2))
    assert visible(admission) == node.cards[2].uuid
    assert admission.containers["main"].envs[c.ENV_MEM_IDX] == "2"
    assert annotations(core_v1, "legacy")[c.ANN_MEM_ASSIGNED] == "true"


def test_overcommit_is_refused_whoever_wrote_the_annotation(node: Node, core_v1: client.CoreV1Api) -> None:
    t4 = node.cards[2]
    assert node.admit(core_v1, gpu_pod("fits", [container("main", 10)], allocation={"main": slices([t4], 10)})).admitted
    hostile = node.admit(core_v1, gpu_pod("greedy", [container("main", 6)], allocation={"main": slices([t4], 6)}))
    assert not hostile.admitted
    assert "pod default/greedy container main" in hostile.error
    assert f"card 2 ({t4.uuid}) would be over-committed" in hostile.error
    assert annotations(core_v1, "greedy")[c.ANN_MEM_ASSIGNED] == "false"
    events = core_v1.list_namespaced_event("default").items
    assert any(e.involved_object.name == "greedy" and e.type == "Warning" for e in events)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({c.ANN_ALLOCATION: "{garbage"}, "not valid JSON"),
        ({c.ANN_MEM_IDX: "two"}, "'two' is not an integer"),
        ({c.ANN_MEM_IDX: "7"}, "card index 7 is not on this node"),
        ({c.ANN_MEM_ASSUME_TIME: "1"}, "neither gpushare.io/allocation nor ALIYUN_COM_GPU_MEM_IDX"),
    ],
)
def test_bad_annotations_give_clear_errors(node: Node, core_v1: client.CoreV1Api, extra, message) -> None:
    pod = gpu_pod("bad", [container("main", 3)], extra_annotations=extra)
    admission = node.admit(core_v1, pod)
    assert not admission.admitted
    assert "pod default/bad" in admission.error and message in admission.error


def test_unknown_card_uuid_is_refused(node: Node, core_v1: client.CoreV1Api) -> None:
    alien = c.CardSlice(0, "GPU-00000000-0000-0000-0000-000000000000", 2)
    admission = node.admit(core_v1, gpu_pod("alien", [container("main", 2)], allocation={"main": (alien,)}))
    assert not admission.admitted and "is not on this node" in admission.error


def test_health_flips_both_ways_in_both_resources(node: Node, core_v1: client.CoreV1Api) -> None:
    t4 = node.cards[2]
    assert node.backend.inject_xid(t4.uuid, 13) is False  # application error: ignored
    assert node.kubelet.allocatable(c.RESOURCE_COUNT) == 3
    node.backend.inject_xid(t4.uuid, 79)
    assert node.kubelet.wait_for(
        lambda k: k.allocatable(c.RESOURCE_COUNT) == 2 and k.allocatable(c.RESOURCE_MEM) == 160, 5
    )
    admission = node.admit(core_v1, gpu_pod("sick", [container("main", 2)], allocation={"main": slices([t4], 2)}))
    assert not admission.admitted and "is unhealthy" in admission.error
    node.backend.recover(t4.uuid)
    assert node.kubelet.wait_for(
        lambda k: k.allocatable(c.RESOURCE_COUNT) == 3 and k.allocatable(c.RESOURCE_MEM) == 175, 5
    )


def test_kubelet_restart_leads_to_registration_within_two_seconds(node: Node) -> None:
    before = node.plugin.plugin.registrations
    node.kubelet.restart()
    started = time.monotonic()
    assert node.kubelet.wait_for(
        lambda k: k.registered(c.RESOURCE_MEM) and k.registered(c.RESOURCE_COUNT) and k.capacity(c.RESOURCE_MEM) == 175,
        2.0,
    )
    assert time.monotonic() - started < 2.0
    wait_until(lambda: node.plugin.plugin.registrations == before + 1, 2.0, "the plugin to count one re-registration")


def test_plugin_restart_assigns_nothing_twice(node: Node, core_v1: client.CoreV1Api) -> None:
    a0, a1, _ = node.cards
    node.admit(core_v1, gpu_pod("first", [container("main", 8)], allocation={"main": slices([a0], 8)}))
    node.plugin.stop()
    node.start_plugin()
    pod = gpu_pod("second", [container("main", 8)], allocation={"main": slices([a1], 8)})
    # a fresh kubelet that lost its checkpoint asks again for 8 units: only "second" may match
    assert visible(node.admit(core_v1, pod)) == a1.uuid
    again = node.kubelet.admit(
        {**gpu_pod("ghost", [container("main", 8)]), "metadata": {"name": "ghost", "namespace": "default", "uid": "g"}}
    )
    assert not again.admitted and "no pending pod" in again.error


def test_api_outage_gives_unavailable_then_recovers(
    node: Node, core_v1: client.CoreV1Api, apiserver: ApiServer
) -> None:
    a0 = node.cards[0]
    node.create(core_v1, gpu_pod("waiting", [container("main", 4)], allocation={"main": slices([a0], 4)}))
    apiserver.pause()
    wait_until(lambda: not node.plugin.cache.connected, 10, "the cache to notice the outage")
    pod = node.plugin.cache.get("waiting", "default")
    during = node.kubelet.admit(pod)
    assert not during.admitted and "API server is unreachable" in during.error
    # ListAndWatch keeps serving meanwhile
    node.backend.inject_xid(node.cards[2].uuid, 79)
    assert node.kubelet.wait_for(lambda k: k.allocatable(c.RESOURCE_COUNT) == 2, 5)
    apiserver.resume()
    wait_until(lambda: node.plugin.cache.connected, 10, "the cache to reconnect")
    assert visible(node.kubelet.admit(pod)) == a0.uuid
