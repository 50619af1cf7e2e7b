"""The CRI shim holds a GPU pod to its share of each card before the pod's GPU container is created:
the driver's limit goes on the pod's cgroup, on the cards that enforce limits, and a limit the driver
doesn't set refuses the container. A pod's share includes what its ResourceClaims were allocated; a
claim that can't be read refuses the container too. When the shim starts, the running pods' cgroups
get their limits again, and when a pod's sandbox ends (StopPodSandbox, RemovePodSandbox) the shim
takes them off its cgroup once the runtime has stopped it; kubelet's call goes on unchanged."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from gpushare.crishim.ending import SandboxEnd
from gpushare.crishim.reconcile import cgroup_parent, clear_stopped, reconcile_limits
from gpushare.crishim.server import DECIDE_WORKERS, CreateContainerGuard, CriShim
from gpushare.crishim.splice import Forward, Refuse
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


class Sandboxes(cri_pb2_grpc.RuntimeServiceServicer):
    """A runtime whose ready sandboxes are those of the pods it is given, each in its own cgroup."""

    def __init__(self, *pods: Target) -> None:
        self.pods = pods
        #: pods with a stopped sandbox (id ``old-<uid>``) as well
        self.stopped: tuple[Target, ...] = ()
        #: what happened, in order: ("stop", sandbox id), as the limits' Driver below records ("set", ...)
        self.calls: list[tuple[str, str]] = []
        self.stop_fails = False

    def ListPodSandbox(self, request: Any, context: Any) -> cri_pb2.ListPodSandboxResponse:
        return cri_pb2.ListPodSandboxResponse(
            items=[
                cri_pb2.PodSandbox(
                    id=f"sb-{p.uid}",
                    metadata=cri_pb2.PodSandboxMetadata(name=p.pod, namespace=p.namespace, uid=p.uid),
                    state=cri_pb2.SANDBOX_READY,
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
        info = {"config": {"linux": {"cgroup_parent": f"/kubepods/burstable/pod{uid}"}}}
        meta = cri_pb2.PodSandboxMetadata(name=pod.pod, namespace=pod.namespace, uid=pod.uid)
        status = cri_pb2.PodSandboxStatus(id=request.pod_sandbox_id, metadata=meta)
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
    assert done == (1, 1)
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
