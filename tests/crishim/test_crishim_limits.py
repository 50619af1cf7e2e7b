"""The CRI shim holds a GPU pod to its share of each card before the pod's GPU container is created:
the driver's limit goes on the pod's cgroup, on the cards that enforce limits, and a limit the driver
doesn't set refuses the container. A pod's share includes what its ResourceClaims were allocated; a
claim that can't be read refuses the container too. When the shim starts, the running pods' cgroups
get their limits again, and when a pod's sandbox ends (StopPodSandbox, RemovePodSandbox) the shim
takes them off its cgroup once the runtime has stopped it; kubelet's call goes on unchanged.

A GPU container's own cgroup gets its share too, soft 0, as kubelet starts it (StartContainer): the
shim makes the cgroup its runtime spec names, sets the limits, and only then forwards the call; a limit
the driver doesn't set, or a runtime that doesn't say what the container is, refuses the start. At the
shim's start the running GPU containers get theirs, and the pod cgroups of pods that ended while it was
away, which the runtime no longer lists, are found and cleared."""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from gpushare.crishim.edge import cgroup_parent
from gpushare.crishim.ending import SandboxEnd
from gpushare.crishim.reconcile import clear_stopped, reconcile_limits
from gpushare.crishim.server import DECIDE_WORKERS, CreateContainerGuard, CriShim
from gpushare.crishim.splice import Forward, Refuse
from gpushare.crishim.starting import ContainerStart
from support.cri import plain_config, plugin_config, request_for
from support.crishim import A0, A1, CARDS, POD, FakePods, allocation_of, pod_dict, slice_of
from support.draclaims import claim, claim_pod, result

from gpushare.cards import ENFORCED
from gpushare.contract.units import GIB
from gpushare.enforcement.container import Target
from gpushare.enforcement.decide import EVENT_REFUSED
from gpushare.enforcement.resolve import Resolver
from gpushare.memlimits.cgroups import V2 as CGROUP_V2
from gpushare.memlimits.cgroups import CgroupLayout
from gpushare.memlimits.enforcer import NO_HARD_LIMIT, MemoryLimitError, PodLimiter
from gpushare.pb import cri_pb2, cri_pb2_grpc
from gpushare.sandbox.containerd import TEST_IMAGE, Containerd, containerd_available, running_containerd
from gpushare.sandbox.nodecgroups import make_cgroup_root, remove_cgroup_root
from gpushare.settings import RewriteOptions

ROOT = Path("/sys/fs/cgroup")
POD_CGROUP = "/kubepods/burstable/poduid-train"
#: A0 and A1 enforce limits; the T4 doesn't (an older driver would say why)
V2 = CgroupLayout(CGROUP_V2, ROOT)
ENFORCING = [replace(c, memory_limits=ENFORCED) if c in (A0, A1) else c for c in CARDS]


class Driver:
    """Records the limits set; refuses with ``refusal`` when given one."""

    def __init__(self, refusal: str = "") -> None:
        self.set: list[tuple[str, Path, int, int]] = []
        self.refusal = refusal

    def __call__(self, uuid: str, cgroup: Path, soft: int, hard: int) -> None:
        if self.refusal:
            raise MemoryLimitError(self.refusal)
        self.set.append((uuid, cgroup, soft, hard))


def guard(
    driver: Driver,
    pods: FakePods | None = None,
    layout: CgroupLayout = V2,
    events: list[tuple[Target, str, str, str]] | None = None,
) -> CreateContainerGuard:
    limiter = PodLimiter(driver, layout, GIB)
    sink = (lambda *event: events.append(event)) if events is not None else None
    return CreateContainerGuard(Resolver(GIB, pods), lambda: ENFORCING, GIB, RewriteOptions(), sink, limiter)


def create(slices: tuple, cgroup: str = POD_CGROUP, **others: tuple) -> bytes:
    request = request_for(POD, allocation_of(worker=slices, **others), plugin_config(POD, list(slices)))
    request.sandbox_config.linux.cgroup_parent = cgroup
    return request.SerializeToString()


def test_the_pods_cgroup_gets_its_share_of_each_enforcing_card_before_the_container_is_created() -> None:
    driver = Driver()
    verdict = guard(driver)(create((slice_of(A0, 8), slice_of(A1, 20))))
    assert isinstance(verdict, Forward)
    pod = ROOT / "kubepods" / "burstable" / "poduid-train"
    assert driver.set == [(A0.uuid, pod, 8 << 30, 8 << 30), (A1.uuid, pod, 20 << 30, 20 << 30)]


def test_the_pods_other_containers_count_toward_its_limit() -> None:
    driver = Driver()
    guard(driver)(create((slice_of(A0, 8),), sidecar=(slice_of(A0, 4),)))
    assert driver.set == [(A0.uuid, ROOT / "kubepods/burstable/poduid-train", 12 << 30, 12 << 30)]


def test_the_pod_from_the_api_counts_by_the_nodes_rule() -> None:
    driver = Driver()
    pods = FakePods([pod_dict("train", "uid-train", {"worker": (slice_of(A0, 8),)}, mem=8)])
    guard(driver, pods)(create((slice_of(A0, 8),)))
    assert [(uuid, hard) for uuid, _, _, hard in driver.set] == [(A0.uuid, 8 << 30)]


def test_a_whole_card_or_a_card_without_enforcement_gets_no_limit() -> None:
    driver = Driver()
    t4 = CARDS[2]
    assert isinstance(guard(driver)(create((slice_of(A0, 80), slice_of(t4, 4)))), Forward)
    assert driver.set == []


def test_a_limit_the_driver_does_not_set_refuses_the_container_naming_pod_card_and_cause() -> None:
    verdict = guard(Driver("nvmlDeviceSetMemoryLimits_v1 failed: Insufficient Resources"))(create((slice_of(A0, 8),)))
    assert isinstance(verdict, Refuse) and verdict.code.name == "FAILED_PRECONDITION"
    assert "pod default/train container worker" in verdict.message
    assert f"card 0 ({A0.uuid})" in verdict.message and "Insufficient Resources" in verdict.message


@pytest.mark.parametrize(
    ("cgroup", "layout", "why"),
    [("", V2, "no cgroup of its own"), (POD_CGROUP, CgroupLayout("v1"), "no cgroup v2 hierarchy")],
)
def test_a_pod_without_a_cgroup_the_driver_can_limit_is_refused_not_run_unlimited(
    cgroup: str, layout: CgroupLayout, why: str
) -> None:
    verdict = guard(Driver(), layout=layout)(create((slice_of(A0, 8),), cgroup))
    assert isinstance(verdict, Refuse) and why in verdict.message and A0.uuid in verdict.message


def test_a_running_sandboxs_cgroup_is_read_from_the_runtimes_verbose_status() -> None:
    assert cgroup_parent('{"config": {"linux": {"cgroup_parent": "/kubepods/podx"}}}') == "/kubepods/podx"
    assert cgroup_parent("not json") == "" and cgroup_parent("") == ""


# --- pods holding cards through ResourceClaims ---------------------------------------------------------------

CLAIM_DEVICE = "gpu.gpushare.io/claim=uid-first-gpu"


def dra_create(cgroup: str = POD_CGROUP) -> bytes:
    """The worker of pod default/train, as kubelet creates it with its claims' CDI device."""
    config = plain_config()
    config.metadata.name = POD.container
    config.CDI_devices.append(cri_pb2.CDIDevice(name=CLAIM_DEVICE))
    request = request_for(POD, {}, config)
    request.sandbox_config.linux.cgroup_parent = cgroup
    return request.SerializeToString()


def train_claim(name: str, *results: dict[str, Any], reserved: bool = True) -> dict[str, Any]:
    return claim(
        *results, name=name, uid=f"uid-{name}", namespace="default", reserved_for=[POD.uid] if reserved else []
    )


def claim_pods(*claims: dict[str, Any], names: tuple[str, ...] = ("first", "second"), fail: bool = False) -> FakePods:
    return FakePods([claim_pod(POD.pod, POD.uid, names, namespace=POD.namespace)], claims=claims, fail=fail)


TWO_CLAIMS = (
    train_claim("first", result(device="card-0", memory="8Gi")),
    train_claim(
        "second",
        result(device="card-0", memory="4Gi", request="a"),
        result(device="card-1", memory="20Gi", request="b"),
        result(device="card-2", memory="4Gi", request="b"),  # the T4 enforces no limits
    ),
)


def test_a_dra_pods_cgroup_gets_the_sum_of_its_claims_on_each_enforcing_card() -> None:
    driver, pods = Driver(), claim_pods(*TWO_CLAIMS)
    verdict = guard(driver, pods)(dra_create())
    assert isinstance(verdict, Forward)
    pod = ROOT / "kubepods" / "burstable" / "poduid-train"
    assert driver.set == [(A0.uuid, pod, 12 << 30, 12 << 30), (A1.uuid, pod, 20 << 30, 20 << 30)]
    # the env and the limits come from one read of each claim
    assert sorted(pods.claims_asked) == sorted(c["metadata"]["name"] for c in TWO_CLAIMS)


def test_a_device_plugin_container_of_a_pod_with_claims_is_limited_to_both() -> None:
    driver = Driver()
    pod = pod_dict("train", "uid-train", {"worker": (slice_of(A0, 8),)}, mem=8)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "first"}]
    pods = FakePods([pod], claims=[train_claim("first", result(device="card-0", memory="4Gi"))])
    assert isinstance(guard(driver, pods)(create((slice_of(A0, 8),))), Forward)
    assert [(uuid, hard) for uuid, _, _, hard in driver.set] == [(A0.uuid, 12 << 30)]


@pytest.mark.parametrize(
    ("pods", "why"),
    [
        (claim_pods(TWO_CLAIMS[0]), "ResourceClaim default/second: not found"),
        (
            claim_pods(*TWO_CLAIMS, fail=True),
            "ResourceClaims for CDI device(s) " + CLAIM_DEVICE + " and pod default/train: API server unreachable",
        ),
        (None, "ResourceClaims for CDI device(s) " + CLAIM_DEVICE + ", and API lookups are disabled (--no-api-fetch)"),
        (
            claim_pods(TWO_CLAIMS[0], train_claim("second", result(), reserved=False)),
            "ResourceClaim default/second (uid uid-second): status.reservedFor does not name pod default/train",
        ),
        (
            claim_pods(train_claim("first", result(pool="node-b")), names=("first",)),
            f"CDI device {CLAIM_DEVICE}: ResourceClaim default/first (uid uid-first) has no request gpu allocated a "
            "card of node node-a",
        ),
    ],
    ids=["claim-missing", "api-down", "api-lookups-off", "not-reserved-for-the-pod", "allocated-elsewhere"],
)
def test_a_dra_pod_whose_claims_cant_be_counted_is_refused_naming_the_claim(pods: FakePods | None, why: str) -> None:
    """Refused before any limit is set: the claims that give the container its cards are its limits too."""
    driver, events = Driver(), []
    verdict = guard(driver, pods, events=events)(dra_create())
    assert isinstance(verdict, Refuse) and verdict.code.name == "FAILED_PRECONDITION"
    assert verdict.message.startswith("pod default/train container worker: ")
    assert why in verdict.message
    assert events == [(POD, EVENT_REFUSED, verdict.message, "Warning")]
    assert driver.set == []


# --- the running pods' limits when the shim starts ------------------------------------------------------------


def pod_cgroup(uid: str) -> str:
    """The cgroup kubelet gives the pod ``uid`` (cgroupfs driver, burstable)."""
    return f"/kubepods/burstable/pod{uid}"


class Sandboxes(cri_pb2_grpc.RuntimeServiceServicer):
    """A runtime whose ready sandboxes are those of the pods it is given, each in its own cgroup, and
    whose containers, each in a cgroup of its own inside its pod's, are those it is given."""

    def __init__(self, *pods: Target) -> None:
        self.pods = pods
        #: pods with a stopped sandbox (id ``old-<uid>``) as well
        self.stopped: tuple[Target, ...] = ()
        #: each pod's annotations, by pod UID
        self.annotations: dict[str, dict[str, str]] = {}
        #: container id -> (its pod's UID, its config as the runtime keeps it, its state)
        self.containers: dict[str, tuple[str, cri_pb2.ContainerConfig, int]] = {}
        #: what happened, in order: ("stop", sandbox id), ("start", container id), as the limits' Driver
        #: below records ("set", card UUID)
        self.calls: list[tuple[str, str]] = []
        self.stop_fails = False
        #: ContainerStatus answers with this code, as a runtime that is restarting does
        self.status_fails: grpc.StatusCode | None = None
        #: where the containers' cgroups are; StartContainer notes whether the container's was there
        self.cgroup_root: Path | None = None
        self.cgroup_there: dict[str, bool] = {}

    def add_container(self, id_: str, pod: Target, config: cri_pb2.ContainerConfig, state: int) -> str:
        """A container of ``pod`` (whose sandbox is ready), as kubelet created it; its cgroup path."""
        self.containers[id_] = (pod.uid, config, state)
        return f"{pod_cgroup(pod.uid)}/{id_}"

    def ListContainers(self, request: Any, context: Any) -> cri_pb2.ListContainersResponse:
        wanted = request.filter.state.state if request.filter.HasField("state") else None
        return cri_pb2.ListContainersResponse(
            containers=[
                cri_pb2.Container(id=id_, pod_sandbox_id=f"sb-{uid}", metadata=config.metadata, state=state)
                for id_, (uid, config, state) in self.containers.items()
                if wanted is None or state == wanted
            ]
        )

    def ContainerStatus(self, request: Any, context: Any) -> cri_pb2.ContainerStatusResponse:
        """As containerd 2 answers a verbose status: the container's config and runtime spec in ``info``."""
        if self.status_fails is not None:
            context.abort(self.status_fails, "the runtime is restarting")
        if request.container_id not in self.containers:
            context.abort(grpc.StatusCode.NOT_FOUND, f"container {request.container_id!r} not found")
        uid, config, state = self.containers[request.container_id]
        info = {
            "sandboxID": f"sb-{uid}",
            "config": MessageToDict(config, preserving_proto_field_name=True),
            "runtimeSpec": {"linux": {"cgroupsPath": f"{pod_cgroup(uid)}/{request.container_id}"}},
        }
        status = cri_pb2.ContainerStatus(id=request.container_id, metadata=config.metadata, state=state)
        return cri_pb2.ContainerStatusResponse(status=status, info={"info": json.dumps(info)})

    def StartContainer(self, request: Any, context: Any) -> cri_pb2.StartContainerResponse:
        self.calls.append(("start", request.container_id))
        if self.cgroup_root is not None:
            uid = self.containers[request.container_id][0]
            cgroup = self.cgroup_root.joinpath(pod_cgroup(uid).lstrip("/"), request.container_id)
            self.cgroup_there[request.container_id] = cgroup.is_dir()
        return cri_pb2.StartContainerResponse()

    def ListPodSandbox(self, request: Any, context: Any) -> cri_pb2.ListPodSandboxResponse:
        return cri_pb2.ListPodSandboxResponse(
            items=[
                cri_pb2.PodSandbox(
                    id=f"sb-{p.uid}",
                    metadata=cri_pb2.PodSandboxMetadata(name=p.pod, namespace=p.namespace, uid=p.uid),
                    state=cri_pb2.SANDBOX_READY,
                    annotations=self.annotations.get(p.uid, {}),
                )
                for p in self.pods
            ]
            + [
                cri_pb2.PodSandbox(
                    id=f"old-{p.uid}",
                    metadata=cri_pb2.PodSandboxMetadata(name=p.pod, namespace=p.namespace, uid=p.uid),
                    state=cri_pb2.SANDBOX_NOTREADY,
                )
                for p in self.stopped
            ]
        )

    def PodSandboxStatus(self, request: Any, context: Any) -> cri_pb2.PodSandboxStatusResponse:
        uid = request.pod_sandbox_id.removeprefix("sb-").removeprefix("old-")
        pod = next((p for p in (*self.pods, *self.stopped) if p.uid == uid), None)
        if pod is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {request.pod_sandbox_id} not found")
        info = {"config": {"linux": {"cgroup_parent": pod_cgroup(uid)}}}
        meta = cri_pb2.PodSandboxMetadata(name=pod.pod, namespace=pod.namespace, uid=pod.uid)
        annotations = self.annotations.get(uid, {})
        status = cri_pb2.PodSandboxStatus(id=request.pod_sandbox_id, metadata=meta, annotations=annotations)
        return cri_pb2.PodSandboxStatusResponse(status=status, info={"info": json.dumps(info)})

    def StopPodSandbox(self, request: Any, context: Any) -> cri_pb2.StopPodSandboxResponse:
        self.calls.append(("stop", request.pod_sandbox_id))
        if self.stop_fails:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the pod's containers did not stop")
        return cri_pb2.StopPodSandboxResponse()


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[tuple[str, Sandboxes]]:
    sandboxes = Sandboxes()
    # a thread per call the tests keep open at once (containerd, in Go, has no such bound)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * DECIDE_WORKERS + 2))
    cri_pb2_grpc.add_RuntimeServiceServicer_to_server(sandboxes, server)
    address = f"unix://{tmp_path}/runtime.sock"
    server.add_insecure_port(address)
    server.start()
    yield address, sandboxes
    server.stop(None).wait()


def test_running_dra_pods_get_their_limits_when_the_shim_starts(
    runtime: tuple[str, Sandboxes], caplog: pytest.LogCaptureFixture
) -> None:
    address, sandboxes = runtime
    broken = Target(POD.namespace, "broken", "uid-broken", "")
    sandboxes.pods = (POD, broken)
    pods = claim_pods(*TWO_CLAIMS)
    pods.pods.append(claim_pod("broken", "uid-broken", ["gone"], namespace=POD.namespace))
    driver = Driver()
    with caplog.at_level(logging.ERROR, logger="gpushare.crishim.reconcile"):
        done = reconcile_limits(address, Resolver(GIB, pods), PodLimiter(driver, V2, GIB), lambda: ENFORCING)
    assert (done.pods, done.pods_failed) == (1, 1)
    pod = ROOT / "kubepods" / "burstable" / "poduid-train"
    assert driver.set == [(A0.uuid, pod, 12 << 30, 12 << 30), (A1.uuid, pod, 20 << 30, 20 << 30)]
    assert [r.getMessage() for r in caplog.records] == [
        "running pod's memory limits not set: pod default/broken: ResourceClaim default/gone: not found"
    ]


# --- a sandbox's end clears its pod's limits ------------------------------------------------------------------


class OrderedDriver(Driver):
    """A driver that notes each limit it sets in the runtime's call list, so that order shows."""

    def __init__(self, calls: list[tuple[str, str]], refuse_on: str = "") -> None:
        super().__init__()
        self.calls = calls
        self.refuse_on = refuse_on

    def __call__(self, uuid: str, cgroup: Path, soft: int, hard: int) -> None:
        if uuid == self.refuse_on:
            raise MemoryLimitError("NVML_ERROR_UNKNOWN")
        self.calls.append(("set", uuid))
        super().__call__(uuid, cgroup, soft, hard)


def ending(address: str, sandboxes: Sandboxes, root: Path, refuse_on: str = "") -> tuple[SandboxEnd, OrderedDriver]:
    sandboxes.pods = (POD,)
    (root / "kubepods" / "burstable" / f"pod{POD.uid}").mkdir(parents=True)
    driver = OrderedDriver(sandboxes.calls, refuse_on)
    limiter = PodLimiter(driver, CgroupLayout(CGROUP_V2, root), GIB)
    return SandboxEnd(address, limiter, lambda: ENFORCING), driver


STOP = cri_pb2.StopPodSandboxRequest(pod_sandbox_id=f"sb-{POD.uid}").SerializeToString()


def test_a_stopped_sandboxs_limits_are_cleared_on_each_enforcing_card_after_the_runtime_stopped_it(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    address, sandboxes = runtime
    end, driver = ending(address, sandboxes, tmp_path)
    assert end(STOP) == Forward(STOP)
    pod = tmp_path / "kubepods" / "burstable" / f"pod{POD.uid}"
    assert driver.set == [(A0.uuid, pod, 0, NO_HARD_LIMIT), (A1.uuid, pod, 0, NO_HARD_LIMIT)]
    assert sandboxes.calls == [("stop", f"sb-{POD.uid}"), ("set", A0.uuid), ("set", A1.uuid)]


def test_an_old_sandbox_of_a_pod_running_on_in_a_new_one_keeps_the_pods_limits(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    """Kubelet recreates a pod's dead sandbox in the same pod cgroup and stops or removes the old one
    later: its containers, running in the new sandbox, keep their limits."""
    address, sandboxes = runtime
    end, driver = ending(address, sandboxes, tmp_path)
    sandboxes.stopped = (POD,)
    old = cri_pb2.StopPodSandboxRequest(pod_sandbox_id=f"old-{POD.uid}").SerializeToString()
    assert end(old) == Forward(old)
    assert sandboxes.calls == [("stop", f"old-{POD.uid}")]
    assert driver.set == []


def test_a_sandbox_the_runtime_did_not_stop_keeps_its_limits_and_the_call_goes_on(
    runtime: tuple[str, Sandboxes], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    address, sandboxes = runtime
    end, driver = ending(address, sandboxes, tmp_path)
    sandboxes.stop_fails = True
    with caplog.at_level(logging.ERROR, logger="gpushare.crishim.ending"):
        assert end(STOP) == Forward(STOP)
    assert driver.set == []
    assert f"sandbox sb-{POD.uid}: memory limits not cleared" in caplog.text


def test_a_limit_the_driver_does_not_clear_is_logged_naming_pod_and_card_and_the_call_goes_on(
    runtime: tuple[str, Sandboxes], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    address, sandboxes = runtime
    end, driver = ending(address, sandboxes, tmp_path, refuse_on=A0.uuid)
    with caplog.at_level(logging.ERROR, logger="gpushare.memlimits.enforcer"):
        assert end(STOP) == Forward(STOP)
    assert [uuid for uuid, *_ in driver.set] == [A1.uuid]
    assert f"pod {POD.namespace}/{POD.pod}: card 0 ({A0.uuid}): limits not cleared" in caplog.text


def test_a_sandbox_the_runtime_no_longer_knows_is_forwarded_untouched(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    address, sandboxes = runtime
    end, driver = ending(address, sandboxes, tmp_path)
    gone = cri_pb2.StopPodSandboxRequest(pod_sandbox_id="sb-gone").SerializeToString()
    assert end(gone) == Forward(gone)
    assert driver.set == [] and sandboxes.calls == []


@pytest.mark.parametrize("method", ["StopPodSandbox", "RemovePodSandbox"])
def test_kubelets_call_through_the_shim_clears_the_limits_and_gets_the_runtimes_answer(
    runtime: tuple[str, Sandboxes], tmp_path: Path, method: str
) -> None:
    address, sandboxes = runtime
    end, driver = ending(address, sandboxes, tmp_path)
    shim = CriShim(f"unix://{tmp_path}/shim.sock", address, guard(Driver()), end)
    shim.start()
    try:
        with grpc.insecure_channel(shim.address) as channel:
            stub = cri_pb2_grpc.RuntimeServiceStub(channel)
            if method == "StopPodSandbox":
                stub.StopPodSandbox(cri_pb2.StopPodSandboxRequest(pod_sandbox_id=f"sb-{POD.uid}"), timeout=10)
            else:
                with pytest.raises(grpc.RpcError) as raised:  # this runtime has no RemovePodSandbox
                    stub.RemovePodSandbox(cri_pb2.RemovePodSandboxRequest(pod_sandbox_id=f"sb-{POD.uid}"), timeout=10)
                assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        shim.stop()
    assert [uuid for uuid, *_ in driver.set] == [A0.uuid, A1.uuid]
    assert sandboxes.calls[0] == ("stop", f"sb-{POD.uid}")


def test_at_start_a_stopped_pods_limits_are_cleared_and_a_running_pods_are_not(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    address, sandboxes = runtime
    ended = Target(POD.namespace, "ended", "uid-ended", "")
    restarted = Target(POD.namespace, "restarted", "uid-restarted", "")
    sandboxes.pods, sandboxes.stopped = (restarted,), (ended, restarted)
    for pod in (ended, restarted):
        (tmp_path / "kubepods" / "burstable" / f"pod{pod.uid}").mkdir(parents=True)
    driver = Driver()
    with grpc.insecure_channel(address) as channel:
        looked = clear_stopped(
            cri_pb2_grpc.RuntimeServiceStub(channel),
            PodLimiter(driver, CgroupLayout(CGROUP_V2, tmp_path), GIB),
            ENFORCING,
        )
    assert looked == 1
    cgroup = tmp_path / "kubepods" / "burstable" / "poduid-ended"
    assert driver.set == [(A0.uuid, cgroup, 0, NO_HARD_LIMIT), (A1.uuid, cgroup, 0, NO_HARD_LIMIT)]


def test_sandboxes_slow_to_stop_never_hold_up_a_containers_check(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    """More sandbox stops than the shim has checking threads, each waiting on its pod's grace period,
    and a CreateContainer that comes meanwhile is still checked and sent on at once."""
    address, _ = runtime
    gate, entered = threading.Event(), threading.Semaphore(0)

    def slow_end(request: bytes) -> Forward:
        entered.release()
        gate.wait(60)
        return Forward(request)

    shim = CriShim(f"unix://{tmp_path}/shim.sock", address, guard(Driver()), slow_end)
    shim.start()
    try:
        with grpc.insecure_channel(shim.address) as channel:
            stub = cri_pb2_grpc.RuntimeServiceStub(channel)
            stops = [
                stub.StopPodSandbox.future(cri_pb2.StopPodSandboxRequest(pod_sandbox_id=f"sb-{n}"), timeout=60)
                for n in range(DECIDE_WORKERS + 1)
            ]
            for _ in range(DECIDE_WORKERS):  # as many stops under way as the shim has checking threads
                assert entered.acquire(timeout=30)
            request = cri_pb2.CreateContainerRequest.FromString(create((slice_of(A0, 8),)))
            with pytest.raises(grpc.RpcError) as raised:  # checked, then answered by this runtime, which has none
                stub.CreateContainer(request, timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert not any(stop.done() for stop in stops)
            gate.set()
            assert all(stop.result() is not None for stop in stops)
    finally:
        gate.set()
        shim.stop()


# --- a GPU container's own limits as it starts ----------------------------------------------------------------

WORKER_ID, SIDECAR_ID = "ctr-worker", "ctr-sidecar"
#: the worker's share: 8 GiB of A0 and 20 GiB of A1 (the T4 enforces no limits)
WORKER_SLICES = (slice_of(A0, 8), slice_of(A1, 20))


def starting(address: str, sandboxes: Sandboxes, root: Path, refuse_on: str = "") -> tuple[ContainerStart, Driver]:
    """The shim's StartContainer check on the runtime ``sandboxes``, whose pod default/train has a GPU
    worker and a sidecar with no GPU, both created; the pod's cgroup is under ``root``."""
    sandboxes.pods = (POD,)
    sandboxes.annotations[POD.uid] = allocation_of(worker=WORKER_SLICES)
    sandboxes.add_container(WORKER_ID, POD, plugin_config(POD, list(WORKER_SLICES)), cri_pb2.CONTAINER_CREATED)
    sandboxes.add_container(SIDECAR_ID, POD, plain_config(("PATH", "/bin")), cri_pb2.CONTAINER_CREATED)
    sandboxes.cgroup_root = root
    (root / pod_cgroup(POD.uid).lstrip("/")).mkdir(parents=True)
    driver = OrderedDriver(sandboxes.calls, refuse_on)
    limiter = PodLimiter(driver, CgroupLayout(CGROUP_V2, root), GIB)
    enforcer = CreateContainerGuard(Resolver(GIB, None), lambda: ENFORCING, GIB, RewriteOptions(), None, limiter)
    return ContainerStart(address, enforcer), driver


def start_through_shim(tmp_path: Path, address: str, start: ContainerStart, container: str) -> None:
    """Kubelet's StartContainer of ``container``, through a shim that checks it with ``start``."""
    shim = CriShim(f"unix://{tmp_path}/shim.sock", address, guard(Driver()), None, start)
    shim.start()
    try:
        with grpc.insecure_channel(shim.address) as channel:
            request = cri_pb2.StartContainerRequest(container_id=container)
            cri_pb2_grpc.RuntimeServiceStub(channel).StartContainer(request, timeout=10)
    finally:
        shim.stop()
        start.close()


def test_a_gpu_containers_start_gets_its_own_cgroup_limited_to_its_share_before_the_runtime_starts_it(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    address, sandboxes = runtime
    start, driver = starting(address, sandboxes, tmp_path)
    start_through_shim(tmp_path, address, start, WORKER_ID)
    cgroup = tmp_path / "kubepods" / "burstable" / f"pod{POD.uid}" / WORKER_ID  # as its runtime spec names it
    assert driver.set == [(A0.uuid, cgroup, 0, 8 << 30), (A1.uuid, cgroup, 0, 20 << 30)]
    assert sandboxes.calls == [("set", A0.uuid), ("set", A1.uuid), ("start", WORKER_ID)]
    assert sandboxes.cgroup_there == {WORKER_ID: True}  # made before the runtime's runc would


def test_a_container_without_a_gpu_starts_untouched(runtime: tuple[str, Sandboxes], tmp_path: Path) -> None:
    address, sandboxes = runtime
    start, driver = starting(address, sandboxes, tmp_path)
    start_through_shim(tmp_path, address, start, SIDECAR_ID)
    assert sandboxes.calls == [("start", SIDECAR_ID)]
    assert driver.set == []  # not one call to the driver
    assert sandboxes.cgroup_there == {SIDECAR_ID: False}  # its cgroup is the runtime's to make


def test_a_limit_the_driver_does_not_set_refuses_the_start_naming_pod_container_and_card(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    address, sandboxes = runtime
    start, _ = starting(address, sandboxes, tmp_path, refuse_on=A1.uuid)
    with pytest.raises(grpc.RpcError) as raised:
        start_through_shim(tmp_path, address, start, WORKER_ID)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = raised.value.details()
    assert details.startswith(f"pod default/train container worker: card 1 ({A1.uuid}): the driver did not set")
    assert "NVML_ERROR_UNKNOWN" in details
    assert ("start", WORKER_ID) not in sandboxes.calls


@pytest.mark.parametrize("how", ["restarting", "no-socket"])
def test_a_runtime_that_does_not_say_what_the_container_is_refuses_its_start(
    runtime: tuple[str, Sandboxes], tmp_path: Path, how: str
) -> None:
    address, sandboxes = runtime
    start, driver = starting(address, sandboxes, tmp_path)
    if how == "restarting":
        sandboxes.status_fails = grpc.StatusCode.UNAVAILABLE
    else:
        start.close()
        start = ContainerStart(f"unix://{tmp_path}/gone.sock", start.enforcer)
    request = cri_pb2.StartContainerRequest(container_id=WORKER_ID).SerializeToString()
    try:
        verdict = start(request)
    finally:
        start.close()
    assert isinstance(verdict, Refuse) and verdict.code == grpc.StatusCode.UNAVAILABLE
    assert verdict.message.startswith(f"container {WORKER_ID} not started: its GPU memory limits can't be set")
    assert driver.set == []


def test_a_container_the_runtime_does_not_know_is_forwarded_for_its_own_answer(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    address, sandboxes = runtime
    start, driver = starting(address, sandboxes, tmp_path)
    request = cri_pb2.StartContainerRequest(container_id="ctr-gone").SerializeToString()
    try:
        assert start(request) == Forward(request)
    finally:
        start.close()
    assert driver.set == []


def test_running_gpu_containers_get_their_own_limits_when_the_shim_starts(
    runtime: tuple[str, Sandboxes], tmp_path: Path
) -> None:
    address, sandboxes = runtime
    starting(address, sandboxes, tmp_path)[0].close()
    for id_ in (WORKER_ID, SIDECAR_ID):
        uid, config, _ = sandboxes.containers[id_]
        sandboxes.containers[id_] = (uid, config, cri_pb2.CONTAINER_RUNNING)
    sandboxes.add_container("ctr-old", POD, plugin_config(POD, list(WORKER_SLICES)), cri_pb2.CONTAINER_EXITED)
    pod = tmp_path / "kubepods" / "burstable" / f"pod{POD.uid}"
    for id_ in (WORKER_ID, SIDECAR_ID):
        (pod / id_).mkdir()  # running: the runtime made them
    driver = Driver()
    limiter = PodLimiter(driver, CgroupLayout(CGROUP_V2, tmp_path), GIB)
    done = reconcile_limits(address, Resolver(GIB, None), limiter, lambda: ENFORCING)
    assert (done.pods, done.pods_failed, done.containers, done.containers_failed) == (1, 0, 1, 0)
    worker = pod / WORKER_ID
    assert driver.set == [
        (A0.uuid, pod, 8 << 30, 8 << 30),
        (A1.uuid, pod, 20 << 30, 20 << 30),
        (A0.uuid, worker, 0, 8 << 30),
        (A1.uuid, worker, 0, 20 << 30),
    ]


def test_a_running_containers_limit_the_driver_does_not_set_is_logged_naming_pod_container_and_card(
    runtime: tuple[str, Sandboxes], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    address, sandboxes = runtime
    starting(address, sandboxes, tmp_path)[0].close()
    uid, config, _ = sandboxes.containers[WORKER_ID]
    sandboxes.containers[WORKER_ID] = (uid, config, cri_pb2.CONTAINER_RUNNING)
    driver = OrderedDriver([], refuse_on=A1.uuid)
    limiter = PodLimiter(driver, CgroupLayout(CGROUP_V2, tmp_path), GIB)
    with caplog.at_level(logging.ERROR, logger="gpushare.crishim.reconcile"):
        done = reconcile_limits(address, Resolver(GIB, None), limiter, lambda: ENFORCING)
    assert (done.pods_failed, done.containers, done.containers_failed) == (1, 0, 1)
    container_errors = [r.getMessage() for r in caplog.records if "running container's" in r.getMessage()]
    assert len(container_errors) == 1
    assert container_errors[0].startswith(
        f"running container's memory limits not set: pod default/train container worker: card 1 ({A1.uuid}): "
        "the driver did not set the container's memory limit"
    )


# --- the start-up sweep of pods that ended while the shim was away ---------------------------------------------

RUNNING = Target("default", "running", "0a0a0a0a-1111-4111-8111-000000000001", "")
ENDED_UID = "0a0a0a0a-1111-4111-8111-000000000002"
BUSY_UID = "0a0a0a0a-1111-4111-8111-000000000003"


def cgroup_with(path: Path, populated: bool) -> Path:
    """A cgroup directory as the kernel shows it: whether a process runs in it or below it."""
    path.mkdir(parents=True)
    (path / "cgroup.events").write_text(f"populated {int(populated)}\nfrozen 0\n")
    return path


def test_the_sweep_clears_an_ended_pods_cgroup_and_its_childrens_and_leaves_one_a_process_runs_in(
    runtime: tuple[str, Sandboxes], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The runtime no longer knows the ended pod's sandboxes: its cgroup is found beside the running pod's."""
    address, sandboxes = runtime
    sandboxes.pods = (RUNNING,)
    kubepods = tmp_path / "kubepods"
    running = cgroup_with(kubepods / "burstable" / f"pod{RUNNING.uid}", populated=True)
    ended = cgroup_with(kubepods / "burstable" / f"pod{ENDED_UID}", populated=False)
    ended_container = cgroup_with(ended / "ctr-left", populated=False)
    busy = cgroup_with(kubepods / "besteffort" / f"pod{BUSY_UID}", populated=True)
    driver = Driver()
    limiter = PodLimiter(driver, CgroupLayout(CGROUP_V2, tmp_path), GIB)
    with caplog.at_level(logging.INFO, logger="gpushare.crishim.reconcile"):
        done = reconcile_limits(address, Resolver(GIB, None), limiter, lambda: ENFORCING)
    assert done.swept == 1
    cleared = [(uuid, cgroup) for uuid, cgroup, soft, hard in driver.set if (soft, hard) == (0, NO_HARD_LIMIT)]
    assert cleared == [(A0.uuid, ended_container), (A1.uuid, ended_container), (A0.uuid, ended), (A1.uuid, ended)]
    assert not any(cgroup in (running, busy) for _, cgroup, *_ in driver.set)
    assert "memory limits cleared on 1 stale pod cgroup(s)" in caplog.text


# --- through a real containerd --------------------------------------------------------------------------------

needs_containerd = pytest.mark.skipif(containerd_available() is not None, reason=str(containerd_available()))
TRAIN_UID = "0a0a0a0a-1111-4111-8111-0000000000aa"
#: the pod's cgroup, as kubelet would name it but under a root of the test's own in the machine's hierarchies
TRAIN_CGROUP = f"/gpushare-crishim-test{pod_cgroup(TRAIN_UID)}"


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    with running_containerd(Path(tempfile.mkdtemp(prefix="gs-ctrd-"))) as daemon:
        yield daemon


class StateNotingDriver(Driver):
    """Notes, with each limit, the state the runtime gives the container then (None: not created yet)."""

    def __init__(self, runtime: cri_pb2_grpc.RuntimeServiceStub, container: list[str]) -> None:
        super().__init__()
        self.runtime = runtime
        self.container = container
        self.states: list[int | None] = []

    def __call__(self, uuid: str, cgroup: Path, soft: int, hard: int) -> None:
        state = None
        if self.container:
            request = cri_pb2.ContainerStatusRequest(container_id=self.container[0])
            state = self.runtime.ContainerStatus(request, timeout=10).status.state
        self.states.append(state)
        super().__call__(uuid, cgroup, soft, hard)


@needs_containerd
def test_containerds_start_of_a_gpu_container_through_the_shim_waits_for_its_limits(
    containerd: Containerd, tmp_path: Path
) -> None:
    """The cgroup the shim limits is the one containerd's runtime spec names, and the limits are set
    while the container is still only created; then containerd starts it."""
    target = Target("default", "train", TRAIN_UID, "worker")
    sandbox = cri_pb2.PodSandboxConfig(
        metadata=cri_pb2.PodSandboxMetadata(name=target.pod, namespace=target.namespace, uid=target.uid),
        annotations=allocation_of(worker=WORKER_SLICES),
        linux=cri_pb2.LinuxPodSandboxConfig(
            cgroup_parent=TRAIN_CGROUP,
            security_context=cri_pb2.LinuxSandboxSecurityContext(
                namespace_options=cri_pb2.NamespaceOption(network=cri_pb2.NODE)
            ),
        ),
    )
    config = plugin_config(target, list(WORKER_SLICES))
    del config.devices[:], config.CDI_devices[:]  # no such nodes here
    config.image.image = TEST_IMAGE
    config.command[:] = ["sleep", "3600"]
    (tmp_path / TRAIN_CGROUP.lstrip("/")).mkdir(parents=True)  # kubelet's, before the sandbox
    direct = grpc.insecure_channel(containerd.address)
    runtime = cri_pb2_grpc.RuntimeServiceStub(direct)
    created: list[str] = []
    driver = StateNotingDriver(runtime, created)
    limiter = PodLimiter(driver, CgroupLayout(CGROUP_V2, tmp_path), GIB)
    enforcer = CreateContainerGuard(Resolver(GIB, None), lambda: ENFORCING, GIB, RewriteOptions(), None, limiter)
    start = ContainerStart(containerd.address, enforcer)
    shim = CriShim(f"unix://{tmp_path}/shim.sock", containerd.address, enforcer, None, start)
    shim.start()
    sandbox_id = ""
    made = make_cgroup_root(TRAIN_CGROUP.split("/")[1])
    try:
        with grpc.insecure_channel(shim.address) as channel:
            kubelet = cri_pb2_grpc.RuntimeServiceStub(channel)
            sandbox_id = kubelet.RunPodSandbox(cri_pb2.RunPodSandboxRequest(config=sandbox), timeout=60).pod_sandbox_id
            create = cri_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox)
            created.append(kubelet.CreateContainer(create, timeout=60).container_id)
            pod_limits = len(driver.set)
            assert pod_limits == 2  # CreateContainer set the pod's, one per enforcing card
            kubelet.StartContainer(cri_pb2.StartContainerRequest(container_id=created[0]), timeout=60)
        status_request = cri_pb2.ContainerStatusRequest(container_id=created[0], verbose=True)
        status = runtime.ContainerStatus(status_request, timeout=10)
        cgroups_path = json.loads(status.info["info"])["runtimeSpec"]["linux"]["cgroupsPath"]
        cgroup = tmp_path / cgroups_path.lstrip("/")
        assert cgroup.parent == tmp_path / TRAIN_CGROUP.lstrip("/") and cgroup.is_dir()
        assert driver.set[pod_limits:] == [(A0.uuid, cgroup, 0, 8 << 30), (A1.uuid, cgroup, 0, 20 << 30)]
        assert driver.states[pod_limits:] == [cri_pb2.CONTAINER_CREATED] * 2
        assert status.status.state == cri_pb2.CONTAINER_RUNNING
    finally:
        shim.stop()
        start.close()
        if sandbox_id:
            runtime.StopPodSandbox(cri_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
            runtime.RemovePodSandbox(cri_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
        direct.close()
        remove_cgroup_root(made)  # and what containerd's runc made below it, in the machine's hierarchies
