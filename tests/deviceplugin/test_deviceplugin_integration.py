"""The device plugin as kubelet meets it: real gRPC over unix sockets, the kubelet emulator on the
other side, and pods kept in the API stand-in, written through the official client."""

from __future__ import annotations

import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from gpushare.deviceplugin import plugin as plugin_module
from gpushare.deviceplugin.devices import card_of_device
from gpushare.deviceplugin.plugin import SOCKETS
from gpushare.deviceplugin.wiring import RunningPlugin, start_device_plugin
from kubernetes import client
from podfactory import container, gpu_pod, slices
from support.waiting import wait_until

from gpushare.contract.allocation import CardSlice, parse_assigned_containers
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_ASSIGNED_CONTAINERS,
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_IDX,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD,
    ENV_CGPU_DISABLE,
    ENV_MEM_IDX,
    ENV_MEM_POD,
    ENV_VISIBLE_DEVICES,
    NODE_ANN_KUBELET_WATCHING,
    NODE_LABEL_CGPU_DISABLE,
    RESOURCE_COUNT,
    RESOURCE_MEM,
    RESOURCES,
)
from gpushare.contract.units import parse_unit
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.kube import nodeapi
from gpushare.observability import serve_http
from gpushare.pb import deviceplugin_pb2 as pb
from gpushare.pb import deviceplugin_pb2_grpc as pb_grpc
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubeletemulator import AdmissionResult, KubeletEmulator, LaggingWatchCache
from gpushare.settings import DEFAULT_REREAD, MetricsEndpoint, NodeSettings, Reread, UsageError

SPEC = "2xA100-80GB:81920,1xT4:15360"
MEM_UNITS = 80 + 80 + 15


class SimNode:
    """Simulated cards, a kubelet emulator and the device plugin, sharing one device-plugins dir."""

    def __init__(self, api: client.ApiClient, core: client.CoreV1Api, directory: Path, spec: str = SPEC) -> None:
        self.api, self.core, self.dir, self.spec = api, core, directory, spec
        self.backend = SimulatedBackend("n1", spec)
        self.cards = self.backend.cards()
        self.kubelet = KubeletEmulator(directory)
        self.kubelet.start()
        self.running: RunningPlugin | None = None
        self.reread = DEFAULT_REREAD

    def settings(self, unit: str = "GiB") -> NodeSettings:
        return NodeSettings("n1", None, f"sim:{self.spec}", self.dir, parse_unit(unit), frozenset(), reread=self.reread)

    def start_plugin(self) -> RunningPlugin:
        self.running = start_device_plugin(self.settings(), self.backend, self.api)
        # the plugin's own flag first: after a restart the emulator still remembers the previous registration
        assert self.running.plugin.wait_registered(5)
        assert self.kubelet.wait_registered(RESOURCE_MEM, 5) and self.kubelet.wait_registered(RESOURCE_COUNT, 5)
        assert self.running.cache.wait_synced(5)
        return self.running

    def stop_plugin(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None

    def create(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Create the pod through the API; returns it once the plugin's node cache holds it."""
        name = self.core.create_namespaced_pod("default", pod).metadata.name
        return wait_until(lambda: self.running.cache.get(name, "default"), what=f"pod {name} in the node cache")

    def admit(self, pod: dict[str, Any]) -> AdmissionResult:
        return self.kubelet.admit(self.create(pod))

    def annotations(self, name: str) -> dict[str, str]:
        return self.core.read_namespaced_pod(name, "default").metadata.annotations or {}

    def channel(self, resource: str) -> grpc.Channel:
        return grpc.insecure_channel(f"unix://{self.dir / SOCKETS[resource]}")


@pytest.fixture
def node(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> Iterator[SimNode]:
    directory = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))  # unix socket paths must stay short
    sim = SimNode(kube_api, core_v1, directory)
    sim.start_plugin()
    yield sim
    sim.stop_plugin()
    sim.kubelet.stop()
    shutil.rmtree(directory, ignore_errors=True)


def visible(admission: AdmissionResult, name: str = "main") -> str:
    assert admission.admitted, admission.error
    return admission.containers[name].envs[ENV_VISIBLE_DEVICES]


def allocate(node: SimNode, resource: str, size: int) -> pb.ContainerAllocateResponse:
    """One Allocate call as kubelet makes it, straight to the plugin's socket."""
    ids = [d for d, health in node.kubelet.devices(resource).items() if health == "Healthy"][:size]
    with node.channel(resource) as channel:
        reply = pb_grpc.DevicePluginStub(channel).Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=5
        )
    assert len(reply.container_responses) == 1
    return reply.container_responses[0]


def refusal_events(core: client.CoreV1Api, pod: str) -> list[str]:
    return [
        e.message
        for e in core.list_namespaced_event("default").items
        if e.involved_object.name == pod and e.type == "Warning"
    ]


# --- registration and device lists ----------------------------------------------------------------------


def test_both_resources_register_and_list_each_card_in_its_own_units(node: SimNode) -> None:
    assert node.kubelet.capacity(RESOURCE_MEM) == MEM_UNITS
    assert node.kubelet.allocatable(RESOURCE_MEM) == MEM_UNITS
    mem = node.kubelet.devices(RESOURCE_MEM)
    assert {card.uuid: sum(d.startswith(card.uuid) for d in mem) for card in node.cards} == {
        node.cards[0].uuid: 80,
        node.cards[1].uuid: 80,
        node.cards[2].uuid: 15,
    }
    count = node.kubelet.devices(RESOURCE_COUNT)
    assert {card.uuid: sum(d.startswith(card.uuid) for d in count) for card in node.cards} == {
        node.cards[0].uuid: 80,
        node.cards[1].uuid: 80,
        node.cards[2].uuid: 15,
    }
    assert set(count.values()) == {"Healthy"}
    for resource in RESOURCES:
        assert node.kubelet.plugin_options(resource).get_preferred_allocation_available
    with node.channel(RESOURCE_COUNT) as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        first = next(stream)
        stream.cancel()
    numa = {card.uuid: card.numa_node for card in node.cards}
    assert all([n.ID for n in d.topology.nodes] == [numa[card_of_device(d.ID)]] for d in first.devices)


def test_a_unit_too_fine_for_one_message_refuses_to_start_and_names_one_that_fits(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    big = SimNode(kube_api, core_v1, directory, spec="8xH200:144384")
    try:
        with pytest.raises(UsageError, match=r"units of MiB needs a [0-9,]+-byte .* use --memory-unit 32MiB"):
            start_device_plugin(big.settings("MiB"), big.backend, kube_api)
        assert not any(directory.glob("gpushare-*.sock"))
        assert not big.kubelet.registered(RESOURCE_MEM)
    finally:
        big.kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


# --- Allocate -----------------------------------------------------------------------------------------


def test_each_container_of_a_multi_container_pod_gets_its_own_card(node: SimNode) -> None:
    a0, a1, t4 = node.cards
    pod = gpu_pod(
        "multi",
        [container("one", 4), container("plain"), container("two", 4)],
        init=[container("setup", 4)],
        allocation={"setup": slices([t4], 4), "one": slices([a0], 4), "two": slices([a1], 4)},
    )
    admission = node.admit(pod)
    assert [visible(admission, n) for n in ("setup", "one", "two")] == [t4.uuid, a0.uuid, a1.uuid]
    assert "plain" not in admission.containers
    assert admission.containers["two"].annotations[CTR_ANN_CONTAINER] == "two"
    assert admission.containers["two"].annotations[CTR_ANN_POD] == "default/multi"
    ann = node.annotations("multi")
    assert ann[ANN_MEM_ASSIGNED] == "true"
    assert set(parse_assigned_containers(ann[ANN_ASSIGNED_CONTAINERS])) == {"setup", "one", "two"}


def test_two_pods_with_equal_requests_each_get_their_own_card(node: SimNode) -> None:
    a0, a1, _ = node.cards
    # created in the opposite order of their assume times: the assume time must decide
    late = node.create(gpu_pod("late", [container("main", 8)], allocation={"main": slices([a0], 8)}, assume_ns=2))
    early = node.create(gpu_pod("early", [container("main", 8)], allocation={"main": slices([a1], 8)}, assume_ns=1))
    assert visible(node.kubelet.admit(early)) == a1.uuid
    assert visible(node.kubelet.admit(late)) == a0.uuid
    assert node.annotations("early")[ANN_MEM_ASSIGNED] == node.annotations("late")[ANN_MEM_ASSIGNED] == "true"


def test_a_two_card_container_gets_the_scheduler_cards_through_both_resources(node: SimNode) -> None:
    _, a1, t4 = node.cards
    admission = node.admit(gpu_pod("pair", [container("main", 20, 2)], allocation={"main": slices([a1, t4], 10)}))
    assert visible(admission) == f"{a1.uuid},{t4.uuid}"
    # one gpu-count replica of each of the scheduler's cards
    assert sorted(card_of_device(d) for d in admission.containers["main"].device_ids[RESOURCE_COUNT]) == sorted(
        [a1.uuid, t4.uuid]
    )
    assert {d.split("-_-")[0] for d in admission.containers["main"].device_ids[RESOURCE_MEM]} == {a1.uuid}


def test_a_pod_carrying_only_the_original_annotations_works(node: SimNode) -> None:
    t4 = node.cards[2]
    admission = node.admit(gpu_pod("legacy", [container("main", 6)], original_index=t4.minor))
    assert visible(admission) == t4.uuid
    assert admission.containers["main"].envs[ENV_MEM_IDX] == "2"
    assert admission.containers["main"].envs[ENV_MEM_POD] == "6"
    assert node.annotations("legacy")[ANN_MEM_ASSIGNED] == "true"


def test_an_over_commit_attempt_is_refused_and_reported_on_the_pod(node: SimNode) -> None:
    t4 = node.cards[2]
    assert node.admit(gpu_pod("fits", [container("main", 10)], allocation={"main": slices([t4], 10)})).admitted
    greedy = node.admit(gpu_pod("greedy", [container("main", 6)], allocation={"main": slices([t4], 6)}))
    assert not greedy.admitted
    assert "(FAILED_PRECONDITION): pod default/greedy container main: card 2" in greedy.error
    assert "would be over-committed" in greedy.error and "default/fits (10)" in greedy.error
    ann = node.annotations("greedy")
    assert ann[ANN_MEM_ASSIGNED] == "false" and ANN_ASSIGNED_CONTAINERS not in ann
    wait_until(
        lambda: any("would be over-committed" in m for m in refusal_events(node.core, "greedy")), what="the Event"
    )


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({ANN_MEM_IDX: "two"}, "'two' is not an integer"),
        ({ANN_MEM_IDX: "7"}, "card 7 (a /dev/nvidia minor number) is not on this node"),
        (
            {ANN_MEM_ASSUME_TIME: "1"},
            "none of gpushare.io/allocation, scheduler.framework.gpushare.allocation or ALIYUN_COM_GPU_MEM_IDX",
        ),
        ({ANN_ALLOCATION: "{garbage", ANN_MEM_IDX: "0"}, "gpushare.io/allocation: not valid JSON"),
    ],
    ids=["non-integer", "out-of-range", "missing-index", "garbage-json"],
)
def test_bad_annotations_are_refused_as_invalid_argument(
    node: SimNode, annotations: dict[str, str], message: str
) -> None:
    admission = node.admit(gpu_pod("bad", [container("main", 3)], extra_annotations=annotations))
    assert not admission.admitted
    assert "UnexpectedAdmissionError" in admission.error and "(INVALID_ARGUMENT)" in admission.error
    assert "pod default/bad container main" in admission.error and message in admission.error
    wait_until(lambda: any(message in m for m in refusal_events(node.core, "bad")), what="the refusal Event")


def test_a_pod_passed_over_on_every_allocate_gets_one_event_with_a_count(node: SimNode) -> None:
    t4 = node.cards[2]
    stuck = gpu_pod("stuck", [container("main", 3)], original_index=t4.minor)
    stuck["metadata"]["annotations"][ANN_MEM_ASSUME_TIME] = "x"
    node.create(stuck)
    for name in ("first", "second"):
        assert visible(node.admit(gpu_pod(name, [container("main", 3)], original_index=t4.minor))) == t4.uuid

    def warnings() -> list[tuple[str, int]]:
        return [
            (e.message, e.count)
            for e in node.core.list_namespaced_event("default").items
            if e.involved_object.name == "stuck" and e.type == "Warning"
        ]

    (message, _), *_ = wait_until(lambda: [w for w in warnings() if w[1] == 2], what="the Event counted twice")
    assert "passed over in Allocate on node n1" in message and "'x' is not integer nanoseconds" in message
    assert warnings() == [(message, 2)]


def test_a_request_no_pod_is_waiting_for_is_refused_not_faked_within_a_bounded_time(node: SimNode) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        allocate(node, RESOURCE_MEM, 5)
    assert time.monotonic() - started < 3.0
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no pending pod on node n1" in error.value.details()
    assert "re-read from the API server 4 time(s)" in error.value.details()


@pytest.mark.parametrize("rereads", [DEFAULT_REREAD.attempts, 0], ids=["rereads", "no-rereads"])
def test_a_pod_kubelet_admits_before_the_plugin_cache_has_it_is_admitted_by_re_reading(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api, monkeypatch: pytest.MonkeyPatch, rereads: int
) -> None:
    """Kubelet admits a pod the moment its watch shows it bound, while the
    plugin's informer is still behind. Allocate must re-read the API server, not refuse."""
    monkeypatch.setattr(nodeapi, "node_pod_cache", lambda api, node: LaggingWatchCache(api, node, 30))
    directory = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    sim = SimNode(kube_api, core_v1, directory)
    try:
        sim.reread = Reread(attempts=rereads)
        sim.start_plugin()
        sim.kubelet.follow(kube_api, "n1")
        _, a1, t4 = sim.cards
        pod = gpu_pod("two-cards", [container("main", 8, 2)], node=None, allocation={"main": slices([a1, t4], 4)})
        core_v1.create_namespaced_pod("default", pod)
        binding = client.V1Binding(
            metadata=client.V1ObjectMeta(name="two-cards"), target=client.V1ObjectReference(kind="Node", name="n1")
        )
        core_v1.create_namespaced_pod_binding("two-cards", "default", binding, _preload_content=False)
        assert sim.kubelet.wait_for(lambda k: "default/two-cards" in k.admissions, 10)
        admission = sim.kubelet.admissions["default/two-cards"]
        if rereads:
            assert visible(admission) == f"{a1.uuid},{t4.uuid}"
            assert sim.annotations("two-cards")[ANN_MEM_ASSIGNED] == "true"
        else:  # the defect this guards against: a refusal for want of a pod the API server has
            assert not admission.admitted and "no pending pod on node n1" in admission.error
    finally:
        sim.stop_plugin()
        sim.kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


# --- health ---------------------------------------------------------------------------------------------


def test_health_flips_both_ways_in_both_resources_and_each_change_is_resent(node: SimNode) -> None:
    t4 = node.cards[2]
    sent = {r: node.kubelet.updates(r) for r in RESOURCES}
    assert node.backend.inject_xid(t4.uuid, 13) is False  # an application error: the card stays healthy
    node.backend.inject_xid(t4.uuid, 79)
    assert node.kubelet.wait_for(
        lambda k: k.allocatable(RESOURCE_COUNT) == MEM_UNITS - 15 and k.allocatable(RESOURCE_MEM) == MEM_UNITS - 15,
        5,
    )
    # exactly one new list per resource: the ignored XID sent nothing
    assert {r: node.kubelet.updates(r) for r in RESOURCES} == {r: n + 1 for r, n in sent.items()}
    assert {h for d, h in node.kubelet.devices(RESOURCE_COUNT).items() if d.startswith(t4.uuid)} == {"Unhealthy"}
    assert node.kubelet.capacity(RESOURCE_MEM) == MEM_UNITS

    sick = node.admit(gpu_pod("sick", [container("main", 2)], allocation={"main": slices([t4], 2)}))
    assert not sick.admitted and f"card 2 ({t4.uuid}) is unhealthy" in sick.error
    node.backend.recover(t4.uuid)
    assert node.kubelet.wait_for(
        lambda k: k.allocatable(RESOURCE_COUNT) == MEM_UNITS and k.allocatable(RESOURCE_MEM) == MEM_UNITS, 5
    )
    assert visible(node.kubelet.admit(node.running.cache.get("sick", "default"))) == t4.uuid


def test_allocate_refuses_a_card_that_turned_unhealthy(node: SimNode) -> None:
    t4 = node.cards[2]
    node.create(gpu_pod("late", [container("main", 2)], allocation={"main": slices([t4], 2)}))
    node.backend.inject_xid(t4.uuid, 79)
    with pytest.raises(grpc.RpcError) as error:
        allocate(node, RESOURCE_MEM, 2)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.value.details() == f"pod default/late container main: assigned card 2 ({t4.uuid}) is unhealthy"


# --- restarts and outages -------------------------------------------------------------------------------


def test_kubelet_restart_leads_to_registration_within_two_seconds(node: SimNode) -> None:
    before = node.running.plugin.registrations
    started = time.monotonic()
    node.kubelet.restart()
    assert node.kubelet.wait_for(
        lambda k: k.capacity(RESOURCE_MEM) == MEM_UNITS and k.capacity(RESOURCE_COUNT) == MEM_UNITS, 2.0
    )
    wait_until(lambda: node.running.plugin.registrations == before + 1, 2.0, "the plugin to count the registration")
    assert time.monotonic() - started < 2.0
    assert (
        visible(node.admit(gpu_pod("after", [container("main", 1)], original_index=node.cards[0].minor)))
        == node.cards[0].uuid
    )


def test_the_node_says_when_no_kubelet_watches_and_the_plugin_registers_on_the_directory_event(
    node: SimNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    node.core.create_node({"metadata": {"name": "n1"}})

    def watching() -> str | None:
        annotations = node.core.read_node("n1").metadata.annotations or {}
        return annotations.get(NODE_ANN_KUBELET_WATCHING)

    wait_until(lambda: watching() == "true", 5, "the node to say kubelet is watching")
    # from here the watchdog never wakes on its own: only the directory's events can wake it
    monkeypatch.setattr(plugin_module, "WATCH_INTERVAL", 60.0)
    before = node.running.plugin.registrations
    node.kubelet.stop()  # its ListAndWatch streams end at once
    wait_until(lambda: watching() == "false", 5, "the node to say no kubelet is watching")
    node.kubelet.restart()
    wait_until(
        lambda: node.running.plugin.registrations == before + 1, 5, "the plugin to register with the new kubelet"
    )
    wait_until(lambda: watching() == "true", 5, "the node to say kubelet is watching again")
    assert node.kubelet.wait_for(lambda k: k.capacity(RESOURCE_MEM) == MEM_UNITS, 2.0)


def test_a_vanished_plugin_socket_is_served_again(node: SimNode) -> None:
    before = node.running.plugin.registrations
    (node.dir / SOCKETS[RESOURCE_MEM]).unlink()
    wait_until(lambda: node.running.plugin.registrations > before, 2.0, "the plugin to register again")
    assert (node.dir / SOCKETS[RESOURCE_MEM]).exists()
    assert node.kubelet.wait_for(lambda k: k.capacity(RESOURCE_MEM) == MEM_UNITS, 2.0)


def test_a_plugin_restart_assigns_nothing_twice(node: SimNode) -> None:
    a0, a1, _ = node.cards
    node.create(
        gpu_pod(
            "halfway",
            [container("one", 8), container("two", 8)],
            allocation={"one": slices([a0], 8), "two": slices([a1], 8)},
        )
    )
    # kubelet's first call reaches the plugin, which then restarts before the second
    assert allocate(node, RESOURCE_MEM, 8).annotations[CTR_ANN_CONTAINER] == "one"
    node.stop_plugin()
    node.start_plugin()
    second = allocate(node, RESOURCE_MEM, 8)
    assert second.annotations[CTR_ANN_CONTAINER] == "two"
    assert second.envs[ENV_VISIBLE_DEVICES] == a1.uuid
    assert node.annotations("halfway")[ANN_MEM_ASSIGNED] == "true"
    with pytest.raises(grpc.RpcError) as error:
        allocate(node, RESOURCE_MEM, 8)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_api_outage_answers_unavailable_while_listandwatch_serves_then_recovers(
    node: SimNode, apiserver: ApiServer
) -> None:
    a0, _, t4 = node.cards
    waiting = node.create(gpu_pod("waiting", [container("main", 4)], allocation={"main": slices([a0], 4)}))
    apiserver.pause()
    try:
        wait_until(lambda: not node.running.cache.connected, 10, "the node cache to notice the outage")
        during = node.kubelet.admit(waiting)
        assert not during.admitted
        assert "(UNAVAILABLE)" in during.error and "API server is unreachable from node n1" in during.error
        node.backend.inject_xid(t4.uuid, 79)
        assert node.kubelet.wait_for(lambda k: k.allocatable(RESOURCE_COUNT) == MEM_UNITS - 15, 5)
    finally:
        apiserver.resume()
    wait_until(lambda: node.running.cache.connected, 10, "the node cache to reconnect")
    assert visible(node.kubelet.admit(waiting)) == a0.uuid
    assert node.annotations("waiting")[ANN_MEM_ASSIGNED] == "true"


# --- observability --------------------------------------------------------------------------------------


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_metrics_show_card_usage_and_refusals_and_probes_follow_readiness(node: SimNode) -> None:
    t4 = node.cards[2]
    ready = {"value": False}
    server = serve_http(MetricsEndpoint("127.0.0.1", 0), lambda: ready["value"])
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert _get(f"{base}/healthz")[0] == 200
        assert _get(f"{base}/readyz")[0] == 503
        ready["value"] = True
        assert _get(f"{base}/readyz")[0] == 200
        node.admit(gpu_pod("user", [container("main", 6)], allocation={"main": slices([t4], 6)}))
        node.admit(gpu_pod("greedy", [container("main", 10)], allocation={"main": slices([t4], 10)}))
        status, body = _get(f"{base}/metrics")
        assert status == 200
        labels = f'card="2",model="{t4.model}",node="n1",uuid="{t4.uuid}"'
        assert t4.model and f"gpushare_card_allocated_units{{{labels}}} 6.0" in body
        assert f"gpushare_card_total_units{{{labels}}} 15.0" in body
        assert f"gpushare_card_healthy{{{labels}}} 1.0" in body
        assert f"gpushare_memory_limits_enforced{{{labels}}} 0.0" in body  # a simulated card
        assert 'gpushare_allocate_failures_total{reason="overcommit",resource="aliyun.com/gpu-mem"}' in body
        assert 'gpushare_allocate_seconds_count{resource="aliyun.com/gpu-mem"}' in body
    finally:
        server.stop()


# --- moving from the original gpushare (see tests/core/test_migration.py) -------------------------------------------


def test_the_cgpu_label_puts_cgpu_disable_in_the_env(node: SimNode) -> None:
    node.core.create_node({"metadata": {"name": "n1", "labels": {NODE_LABEL_CGPU_DISABLE: "true"}}})
    card = node.cards[0]
    admission = node.admit(
        gpu_pod("isolated-off", [container("main", 2)], allocation={"main": (CardSlice(card.index, card.uuid, 2),)})
    )
    assert visible(admission) == card.uuid
    assert admission.containers["main"].envs[ENV_CGPU_DISABLE] == "true"
    node.core.patch_node("n1", {"metadata": {"labels": {NODE_LABEL_CGPU_DISABLE: None}}})
    admission = node.admit(
        gpu_pod("isolated", [container("main", 2)], allocation={"main": (CardSlice(card.index, card.uuid, 2),)})
    )
    assert ENV_CGPU_DISABLE not in admission.containers["main"].envs


def test_allocate_env_and_inspect_use_the_effective_request(node: SimNode) -> None:
    card = node.cards[2]
    slices = {name: (CardSlice(card.index, card.uuid, units),) for name, units in (("init", 9), ("main", 6))}
    pod = gpu_pod("p", [container("main", 6)], init=[container("init", 9)], allocation=slices)
    admission = node.admit(pod)
    assert admission.admitted, admission.error
    assert admission.containers["main"].envs[ENV_MEM_POD] == "9" == admission.containers["init"].envs[ENV_MEM_POD]
    # a second pod fits next to it: the card holds max(6, 9) = 9 of 15, not 15
    assert node.admit(
        gpu_pod("q", [container("main", 6)], allocation={"main": (CardSlice(card.index, card.uuid, 6),)})
    ).admitted
