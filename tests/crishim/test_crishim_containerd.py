"""The CRI shim between a client playing kubelet and a real, private containerd.

Containers really start, and the env their process got is read back with ExecSync. A scripted runtime
(an in-process gRPC server) covers what containerd 1.6 can't show: a live event stream, metadata and
rich error details.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import podfactory
import pytest
from gpushare.crishim.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    ERROR_CANCEL,
    HEADERS,
    PING,
    PREFACE,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    frame,
    frame_at,
    grpc_message,
    rst_stream,
)
from gpushare.crishim.metrics import CORRECTIONS, REFUSALS
from gpushare.crishim.server import CreateContainerGuard, CriShim
from gpushare.crishim.wiring import RunningShim, start_cri_shim
from gpushare.draplugin.cdi import remove_spec, write_spec
from gpushare.draplugin.prepare import prepare_claim
from hpack import Encoder
from kubernetes import client
from support.crishim import FakePods
from support.draclaims import REF, claim, claim_pod, result
from support.waiting import wait_until

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.dra import format_claim_env_key
from gpushare.contract.env import assigned_env, toolkit_memory_env
from gpushare.contract.names import (
    ANN_ALLOCATION,
    CRI_LABEL_CONTAINER_NAME,
    CTR_ANN_CARDS,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD,
    CTR_ANN_POD_UID,
    ENV_MEM_CONTAINER,
    ENV_MEM_IDX,
    ENV_MEM_POD,
    ENV_VISIBLE_DEVICES,
    VISIBLE_DEVICES_VOID,
)
from gpushare.contract.resourceclaim import ClaimRef
from gpushare.contract.units import GIB
from gpushare.enforcement.decide import EVENT_CORRECTED
from gpushare.enforcement.resolve import Resolver
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.pb import cri_pb2 as pb
from gpushare.pb import cri_pb2_grpc as pb_grpc
from gpushare.sandbox import cri_kubelet
from gpushare.sandbox.containerd import TEST_IMAGE, Containerd, containerd_available, running_containerd
from gpushare.settings import NodeSettings, RewriteOptions, ShimSettings

NODE = "node-a"
GPUS = "2xA100-80GB:81920,1xT4:15360"
BACKEND = SimulatedBackend(NODE, GPUS)
CARDS = BACKEND.cards()
UNITS = {c.uuid: GIB.units_of(c.memory_mib) for c in CARDS}

needs_containerd = pytest.mark.skipif(containerd_available() is not None, reason=str(containerd_available()))


def node_settings() -> NodeSettings:
    return NodeSettings(
        node_name=NODE,
        kubeconfig=None,
        gpus=f"sim:{GPUS}",
        device_plugin_dir=Path("/nonexistent"),
        memory_unit=GIB,
        ignored_xids=frozenset(),
    )


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    with running_containerd(Path(tempfile.mkdtemp(prefix="gs-ctrd-"))) as daemon:
        yield daemon


ShimFactory = Callable[..., RunningShim]


@pytest.fixture
def start_shim(tmp_path: Path) -> Iterator[ShimFactory]:
    started: list[RunningShim] = []

    def start(runtime: str, api: Any = None, allow_api_fetch: bool = False, **options: bool) -> RunningShim:
        settings = ShimSettings(
            listen=f"unix://{tmp_path}/shim-{len(started)}.sock",
            runtime=runtime,
            allow_api_fetch=allow_api_fetch,
            options=RewriteOptions(**options),
        )
        running = start_cri_shim(node_settings(), settings, BACKEND, api)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


class Cri:
    """Runtime and image service stubs on one channel."""

    def __init__(self, address: str, options: tuple[tuple[str, Any], ...] = ()) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=options)
        self.runtime = pb_grpc.RuntimeServiceStub(self.channel)
        self.images = pb_grpc.ImageServiceStub(self.channel)

    def raw(self, method: str, request: bytes, timeout: float = 10) -> bytes:
        return self.channel.unary_unary(method)(request, timeout=timeout)


@pytest.fixture
def direct(containerd: Containerd) -> Iterator[Cri]:
    cri = Cri(containerd.address)
    yield cri
    for sandbox in cri.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
        cri.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=30)
        cri.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=30)
    cri.channel.close()


@pytest.fixture
def shim(containerd: Containerd, direct: Cri, start_shim: ShimFactory) -> Iterator[Cri]:
    """A shim trusting sandbox_config alone (no API server)."""
    cri = Cri(start_shim(containerd.address).shim.address)
    yield cri
    cri.channel.close()


# --- kubelet's side ---------------------------------------------------------------------------------------


def sandbox_config(pod: str, uid: str, annotations: dict[str, str] | None = None) -> pb.PodSandboxConfig:
    return cri_kubelet.sandbox_config(
        {"metadata": {"name": pod, "namespace": "default", "uid": uid, "annotations": annotations}}
    )


def plugin_answer(pod: str, uid: str, container: str, slices: tuple[CardSlice, ...]) -> dict[str, Any]:
    """What our device plugin's Allocate answer puts into a container it believes belongs to ``pod``."""
    return {
        "envs": assigned_env(slices, sum(s.units for s in slices), UNITS) | toolkit_memory_env(slices, GIB.mib),
        "annotations": {
            CTR_ANN_POD_UID: uid,
            CTR_ANN_POD: f"default/{pod}",
            CTR_ANN_CONTAINER: container,
            CTR_ANN_CARDS: ",".join(s.uuid for s in slices),
        },
    }


def container_config(name: str, envs: dict[str, str], annotations: dict[str, str] | None = None) -> pb.ContainerConfig:
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=TEST_IMAGE),
        command=["sleep", "3600"],
        envs=[pb.KeyValue(key=k, value=v) for k, v in envs.items()],
        labels={CRI_LABEL_CONTAINER_NAME: name},
        annotations=annotations or {},
    )


def run_container(cri: Cri, sandbox: pb.PodSandboxConfig, config: pb.ContainerConfig) -> str:
    sandbox_id = cri.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox), timeout=30).pod_sandbox_id
    container_id = cri.runtime.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox), timeout=30
    ).container_id
    cri.runtime.StartContainer(pb.StartContainerRequest(container_id=container_id), timeout=30)
    return container_id


def process_env(cri: Cri, container_id: str) -> dict[str, str]:
    reply = cri.runtime.ExecSync(pb.ExecSyncRequest(container_id=container_id, cmd=["env"], timeout=10), timeout=15)
    assert reply.exit_code == 0, reply.stderr
    return dict(line.split("=", 1) for line in reply.stdout.decode().splitlines() if "=" in line)


def slice_of(index: int, units: int = 20) -> CardSlice:
    return CardSlice(index=index, uuid=CARDS[index].uuid, units=units)


def api_pod(name: str, allocation: dict[str, tuple[CardSlice, ...]]) -> dict[str, Any]:
    worker = podfactory.container("worker", 20, image=TEST_IMAGE)
    annotations = {ANN_ALLOCATION: format_allocation(allocation)}
    return podfactory.gpu_pod(name, [worker], node=NODE, extra_annotations=annotations)


def counter(metric: Any, reason: str) -> float:
    return metric.labels(reason)._value.get()


# --- enforcement ------------------------------------------------------------------------------------------


@needs_containerd
def test_swapped_device_plugin_answers_land_on_the_assigned_cards(
    containerd: Containerd, direct: Cri, start_shim: ShimFactory, core_v1: client.CoreV1Api, kube_api: client.ApiClient
) -> None:
    """Two pods ask for the same amount; the plugin gave each the other's card. Each must run on its own."""
    pods = {"train": slice_of(0), "infer": slice_of(1)}
    uids = {}
    for name, card in pods.items():
        created = core_v1.create_namespaced_pod("default", api_pod(name, {"worker": (card,)}), _preload_content=False)
        uids[name] = json.loads(created.data)["metadata"]["uid"]
    running = start_shim(containerd.address, api=kube_api, allow_api_fetch=True)
    assert running.cache is not None and running.cache.wait_synced(5)
    cri = Cri(running.shim.address)
    before = counter(CORRECTIONS, "wrong-card")

    containers = {}
    for name, other in (("train", "infer"), ("infer", "train")):
        sandbox = sandbox_config(name, uids[name], {ANN_ALLOCATION: format_allocation({"worker": (pods[name],)})})
        swapped = plugin_answer(other, uids[other], "worker", (pods[other],))
        containers[name] = run_container(cri, sandbox, container_config("worker", **swapped))

    for name, card in pods.items():
        env = process_env(direct, containers[name])
        assert env[ENV_VISIBLE_DEVICES] == card.uuid
        assert env[ENV_MEM_IDX] == str(card.index)
        status = direct.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=containers[name]), timeout=10)
        assert status.status.annotations[CTR_ANN_CARDS] == card.uuid
        assert status.status.annotations[CTR_ANN_POD_UID] == uids[name]
    assert counter(CORRECTIONS, "wrong-card") == before + 2

    def corrected_events() -> list[dict[str, Any]]:
        events = json.loads(core_v1.list_namespaced_event("default", _preload_content=False).data)["items"]
        return [e for e in events if e["reason"] == EVENT_CORRECTED]

    events = wait_until(lambda: len(corrected_events()) == 2 and corrected_events(), what="two correction events")
    assert {e["involvedObject"]["name"] for e in events} == {"train", "infer"}


@needs_containerd
def test_container_without_gpu_request_gets_void(shim: Cri, direct: Cri) -> None:
    sandbox = sandbox_config("sneaky", "uid-sneaky")
    before = counter(CORRECTIONS, "unrequested-gpu")
    container = run_container(shim, sandbox, container_config("main", {ENV_VISIBLE_DEVICES: "all", "KEEP": "me"}))
    env = process_env(direct, container)
    assert env[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID and env["KEEP"] == "me"
    assert counter(CORRECTIONS, "unrequested-gpu") == before + 1


@needs_containerd
def test_a_container_with_two_claims_sees_both_cards_through_containerd(
    containerd: Containerd, direct: Cri, tmp_path: Path
) -> None:
    """The kubelet plugin prepared two claims (their CDI specs are in containerd's CDI directory) on two
    cards; kubelet creates a container with both claims' CDI devices. containerd applies CDI env edits
    after the config's env, the last device winning, so the shim's env of both cards must not be
    overridden by either spec."""
    refs = [REF, ClaimRef(REF.namespace, "claim-2", "0b5c9f1e-1111-2222-3333-777788889999")]
    claims = [
        claim(
            result(device=f"card-{i}", memory=f"{8 * (i + 1)}Gi"), uid=ref.uid, name=ref.name, reserved_for=["uid-dra"]
        )
        for i, ref in enumerate(refs)
    ]
    cdi_dir = containerd.base / "cdi"
    devices = []
    for ref, raw in zip(refs, claims, strict=True):
        prepared = prepare_claim(raw, ref, NODE, CARDS, GIB.mib, {})
        write_spec(cdi_dir, ref.uid, prepared.spec)
        devices += [d.cdi_device_id for d in prepared.devices]
    pod = claim_pod("dra", "uid-dra", [r.name for r in refs], namespace="default", node=NODE)
    guard = CreateContainerGuard(Resolver(GIB, FakePods([pod], claims=claims)), lambda: CARDS, GIB, RewriteOptions())
    shim = CriShim(f"unix://{tmp_path}/shim.sock", containerd.address, guard)
    shim.start()
    cri = Cri(shim.address)
    try:
        config = container_config("worker", {"KEEP": "me", ENV_VISIBLE_DEVICES: "all"})
        config.CDI_devices.extend(pb.CDIDevice(name=d) for d in devices)
        env = process_env(direct, run_container(cri, sandbox_config("dra", "uid-dra"), config))
        assert env[ENV_VISIBLE_DEVICES] == f"{CARDS[0].uuid},{CARDS[1].uuid}" and env["KEEP"] == "me"
        assert (env[ENV_MEM_IDX], env[ENV_MEM_CONTAINER], env[ENV_MEM_POD]) == ("0,1", "24", "24")
        assert {k for k in env if k.startswith("GPUSHARE_CLAIM_")} == {
            format_claim_env_key(ref.uid, "gpu") for ref in refs
        }  # each spec's own variable
    finally:
        cri.channel.close()
        shim.stop()
        for ref in refs:
            remove_spec(cdi_dir, ref.uid)


@needs_containerd
@pytest.mark.parametrize(
    "annotations",
    [{}, {ANN_ALLOCATION: format_allocation({"worker": (CardSlice(0, "GPU-not-on-this-node", 20),)})}],
    ids=["no-assignment", "unknown-card"],
)
def test_gpu_container_without_valid_assignment_is_refused(shim: Cri, direct: Cri, annotations: dict[str, str]) -> None:
    sandbox = sandbox_config("orphan", "uid-orphan", annotations)
    sandbox_id = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox), timeout=30).pod_sandbox_id
    answer = plugin_answer("orphan", "uid-orphan", "worker", (slice_of(0),))
    before = counter(REFUSALS, "no-assignment")
    with pytest.raises(grpc.RpcError) as info:
        shim.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=sandbox_id, config=container_config("worker", **answer), sandbox_config=sandbox
            ),
            timeout=30,
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pod default/orphan container worker" in info.value.details()
    assert counter(REFUSALS, "no-assignment") == before + 1
    listed = direct.runtime.ListContainers(
        pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=sandbox_id)), timeout=10
    )
    assert not listed.containers


# --- transparency -----------------------------------------------------------------------------------------


@needs_containerd
def test_pass_through_matches_talking_to_containerd_directly(shim: Cri, direct: Cri) -> None:
    container = run_container(shim, sandbox_config("plain", "uid-plain"), container_config("main", {}))
    assert shim.runtime.Version(pb.VersionRequest(), timeout=10) == direct.runtime.Version(pb.VersionRequest())
    listed = shim.runtime.ListContainers(pb.ListContainersRequest(), timeout=10)
    assert [c.id for c in listed.containers] == [container]
    assert listed == direct.runtime.ListContainers(pb.ListContainersRequest(), timeout=10)
    status = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=container, verbose=True), timeout=10)
    assert status.status.state == pb.CONTAINER_RUNNING and "info" in status.info
    assert json.loads(status.info["info"])["config"]["metadata"]["name"] == "main"
    reply = shim.runtime.ExecSync(pb.ExecSyncRequest(container_id=container, cmd=["sh", "-c", "echo hi; exit 3"]))
    assert (reply.stdout, reply.exit_code) == (b"hi\n", 3)
    images = shim.images.ListImages(pb.ListImagesRequest(), timeout=10)
    assert any(TEST_IMAGE in image.repo_tags for image in images.images)
    assert images == direct.images.ListImages(pb.ListImagesRequest(), timeout=10)
    image = shim.images.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=TEST_IMAGE)), timeout=10)
    assert TEST_IMAGE in image.image.repo_tags


@needs_containerd
def test_errors_keep_their_code_and_details(shim: Cri, direct: Cri) -> None:
    def failure(cri: Cri) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            cri.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id="no-such-container"), timeout=10)
        return info.value

    through, straight = failure(shim), failure(direct)
    assert through.code() == straight.code() == grpc.StatusCode.NOT_FOUND
    assert through.details() == straight.details() and "no-such-container" in through.details()


def forward_events(stream: Any, events: queue.Queue[Any]) -> None:
    """Put each reply of a GetContainerEvents stream into ``events`` until the stream is cancelled."""
    with contextlib.suppress(grpc.RpcError):
        for event in stream:
            events.put(event)


def events_until_started(events: queue.Queue[Any], container_id: str) -> list[int]:
    """The types of ``container_id``'s events among the GetContainerEvents replies in ``events`` (which
    also replay other containers' recent events), up to its started event."""
    seen: list[int] = []
    while pb.CONTAINER_STARTED_EVENT not in seen:
        event = events.get(timeout=30)
        if event.container_id == container_id:
            seen.append(event.container_event_type)
    return seen


@needs_containerd
def test_container_events_stream_through_the_shim_as_they_happen(shim: Cri, direct: Cri) -> None:
    """containerd 2 serves GetContainerEvents, which kubelet keeps open for as long as it runs: the shim
    passes each event on as it comes, the same events kubelet would see from containerd itself."""
    streams = [cri.runtime.GetContainerEvents(pb.GetEventsRequest(), timeout=60) for cri in (shim, direct)]
    received: list[queue.Queue[Any]] = [queue.Queue(), queue.Queue()]
    for stream, events in zip(streams, received, strict=True):
        threading.Thread(target=forward_events, args=(stream, events), daemon=True).start()
    container = run_container(direct, sandbox_config("events", "uid-events"), container_config("main", {}))
    via_shim, via_containerd = (events_until_started(events, container) for events in received)
    for stream in streams:
        stream.cancel()
    assert via_shim == via_containerd == [pb.CONTAINER_CREATED_EVENT, pb.CONTAINER_STARTED_EVENT]


@needs_containerd
def test_method_the_shim_never_heard_of_is_forwarded(shim: Cri) -> None:
    """A method newer than the shim's protos reaches containerd, and containerd's answer reaches kubelet."""
    with pytest.raises(grpc.RpcError) as info:
        shim.raw("/runtime.v1.RuntimeService/NoSuchMethodYet", b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "NoSuchMethodYet" in info.value.details()


@needs_containerd
def test_deadline_reaches_containerd(shim: Cri, direct: Cri) -> None:
    container = run_container(shim, sandbox_config("slow", "uid-slow"), container_config("main", {}))

    def sleeping() -> bool:
        ps = direct.runtime.ExecSync(pb.ExecSyncRequest(container_id=container, cmd=["ps", "-o", "args"]), timeout=10)
        return "sleep 30" in ps.stdout.decode().splitlines()

    with futures.ThreadPoolExecutor(1) as caller:
        call = caller.submit(
            shim.runtime.ExecSync, pb.ExecSyncRequest(container_id=container, cmd=["sleep", "30"]), timeout=3
        )
        wait_until(sleeping, 10, "the exec to run in the container")
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=20)
    # the caller's own timer, or containerd's reset of the stream at the same deadline, whichever comes first
    assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), info.value
    # containerd got the deadline too: it ends the exec long before its 30 s are up
    wait_until(lambda: not sleeping(), 10, "containerd to end the exec at the deadline")


@needs_containerd
def test_socket_is_private(containerd: Containerd, start_shim: ShimFactory) -> None:
    running = start_shim(containerd.address)
    mode = os.stat(running.shim.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


@needs_containerd
def test_containerd_outage_answers_unavailable_then_recovers(containerd: Containerd, shim: Cri) -> None:
    assert shim.runtime.Version(pb.VersionRequest(), timeout=10).runtime_name == "containerd"
    containerd.stop()
    try:
        with pytest.raises(grpc.RpcError) as info:
            shim.runtime.Version(pb.VersionRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        containerd.start()

    def answers() -> bool:
        try:
            return shim.runtime.Version(pb.VersionRequest(), timeout=1).runtime_name == "containerd"
        except grpc.RpcError:
            return False

    wait_until(answers, timeout=10, what="the shim to reach the restarted containerd")


# --- a scripted runtime: what containerd 1.6 can't demonstrate ---------------------------------------------------


#: generous limits on both ends, so that the shim's own handling of large requests is what is tested
BIG = (("grpc.max_metadata_size", 1 << 20), ("grpc.max_receive_message_length", 64 << 20))
LISTED = 400  # containers in the scripted ListContainers answer: about 40 KB, several DATA frames


class ScriptedRuntime(pb_grpc.RuntimeServiceServicer):
    def __init__(self) -> None:
        self.seen_metadata: dict[str, str] = {}
        self.seen_deadline: float | None = None
        self.created: list[pb.CreateContainerRequest] = []

    def CreateContainer(self, request: pb.CreateContainerRequest, context: grpc.ServicerContext) -> Any:
        self.created.append(request)
        return pb.CreateContainerResponse(container_id=request.config.metadata.name)

    def ListContainers(self, request: pb.ListContainersRequest, context: grpc.ServicerContext) -> Any:
        return pb.ListContainersResponse(
            containers=[pb.Container(id=f"{n:064x}", labels={"n": str(n)}) for n in range(LISTED)]
        )

    def Version(self, request: pb.VersionRequest, context: grpc.ServicerContext) -> pb.VersionResponse:
        self.seen_metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.seen_deadline = context.time_remaining()
        context.send_initial_metadata((("x-runtime-initial", "hello"),))
        context.set_trailing_metadata((("x-runtime-trailing", "bye"),))
        return pb.VersionResponse(runtime_name="scripted", version=request.version)

    def ContainerStatus(self, request: pb.ContainerStatusRequest, context: grpc.ServicerContext) -> Any:
        context.set_trailing_metadata((("grpc-status-details-bin", b"\x08\x05\x12\x04gone"), ("x-why", "gone")))
        context.abort(grpc.StatusCode.NOT_FOUND, f"container {request.container_id} is gone")

    def GetContainerEvents(self, request: pb.GetEventsRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        for n, kind in enumerate((pb.CONTAINER_CREATED_EVENT, pb.CONTAINER_STARTED_EVENT, pb.CONTAINER_STOPPED_EVENT)):
            yield pb.ContainerEventResponse(container_id=f"c{n}", container_event_type=kind)


class Echo(grpc.GenericRpcHandler):
    """A bidirectional method no proto of ours declares: echoes every message back, reversed."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method != "/future.v9.Runtime/Chat":
            return None
        return grpc.stream_stream_rpc_method_handler(lambda requests, _context: (r[::-1] for r in requests))


@pytest.fixture
def scripted(tmp_path: Path, start_shim: ShimFactory) -> Iterator[tuple[ScriptedRuntime, Cri]]:
    runtime = ScriptedRuntime()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), handlers=[Echo()], options=BIG)
    pb_grpc.add_RuntimeServiceServicer_to_server(runtime, server)
    server.add_insecure_port(f"unix:{tmp_path}/runtime.sock")
    server.start()
    cri = Cri(start_shim(f"unix://{tmp_path}/runtime.sock").shim.address)
    yield runtime, cri
    cri.channel.close()
    server.stop(0)


def test_metadata_and_deadline_cross_in_both_directions(scripted: tuple[ScriptedRuntime, Cri]) -> None:
    runtime, cri = scripted
    reply, call = cri.runtime.Version.with_call(
        pb.VersionRequest(version="v1"), timeout=7, metadata=(("x-kubelet", "node-a"),)
    )
    assert reply.runtime_name == "scripted" and reply.version == "v1"
    assert runtime.seen_metadata.get("x-kubelet") == "node-a"
    # the caller's 7 s deadline arrives: less whatever the hop took, plus the wire encoding's rounding
    assert runtime.seen_deadline is not None and 1 < runtime.seen_deadline <= 7.1
    assert ("x-runtime-initial", "hello") in tuple(call.initial_metadata())
    assert ("x-runtime-trailing", "bye") in tuple(call.trailing_metadata())


def test_error_details_are_not_lost(scripted: tuple[ScriptedRuntime, Cri]) -> None:
    _, cri = scripted
    with pytest.raises(grpc.RpcError) as info:
        cri.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id="c9"), timeout=5)
    trailing = dict(info.value.trailing_metadata())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details() == "container c9 is gone"
    assert trailing["grpc-status-details-bin"] == b"\x08\x05\x12\x04gone" and trailing["x-why"] == "gone"


def test_event_stream_is_relayed_message_by_message(scripted: tuple[ScriptedRuntime, Cri]) -> None:
    _, cri = scripted
    events = list(cri.runtime.GetContainerEvents(pb.GetEventsRequest(), timeout=5))
    assert [(e.container_id, e.container_event_type) for e in events] == [
        ("c0", pb.CONTAINER_CREATED_EVENT),
        ("c1", pb.CONTAINER_STARTED_EVENT),
        ("c2", pb.CONTAINER_STOPPED_EVENT),
    ]


def test_unknown_bidirectional_method_is_relayed(scripted: tuple[ScriptedRuntime, Cri]) -> None:
    _, cri = scripted
    chat = cri.channel.stream_stream("/future.v9.Runtime/Chat")
    assert list(chat(iter([b"abc", b"xyz"]), timeout=5)) == [b"cba", b"zyx"]


# --- the splice under load: held requests larger than the windows, refusals, continuation frames ------------


def create_request(name: str, annotation_bytes: int, wants_gpu: bool = False) -> pb.CreateContainerRequest:
    """A CreateContainer whose pod carries ``annotation_bytes`` of annotations (kubectl's last-applied
    configuration makes them large in real clusters)."""
    annotations = {f"example.com/blob-{n}": "x" * 50_000 for n in range(annotation_bytes // 50_000)}
    sandbox = sandbox_config(name, f"uid-{name}", annotations)
    answer = plugin_answer(name, f"uid-{name}", "worker", (slice_of(0),)) if wants_gpu else {"envs": {}}
    return pb.CreateContainerRequest(
        pod_sandbox_id="sandbox", config=container_config(name, **answer), sandbox_config=sandbox
    )


def env_of(request: pb.CreateContainerRequest) -> dict[str, str]:
    return {kv.key: kv.value for kv in request.config.envs}


def test_requests_larger_than_the_runtimes_windows_are_held_and_sent_whole(
    scripted: tuple[ScriptedRuntime, Cri],
) -> None:
    runtime, cri = scripted
    request = create_request("big", 6_000_000)  # over the runtime's 4 MiB stream window
    assert cri.runtime.CreateContainer(request, timeout=20).container_id == "big"
    (seen,) = runtime.created
    assert env_of(seen)[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID  # checked, corrected
    assert dict(seen.sandbox_config.annotations) == dict(request.sandbox_config.annotations)


def test_concurrent_calls_keep_both_ends_flow_control_in_step(scripted: tuple[ScriptedRuntime, Cri]) -> None:
    """Held, rewritten (longer) requests, big answers and small calls share one connection. If the
    shim's window accounting drifted, the connection would stall or be torn down by a peer."""
    runtime, cri = scripted

    def worker(n: int) -> None:
        for i in range(12):
            name = f"w{n}-{i}"
            assert cri.runtime.CreateContainer(create_request(name, 100_000 * (i % 3)), timeout=20).container_id == name
            assert len(cri.runtime.ListContainers(pb.ListContainersRequest(), timeout=20).containers) == LISTED
            assert cri.runtime.Version(pb.VersionRequest(), timeout=20).runtime_name == "scripted"

    with futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(worker, range(8)))
    assert len(runtime.created) == 96
    assert all(env_of(r)[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID for r in runtime.created)


def test_refused_requests_never_reach_the_runtime_and_leave_the_connection_usable(
    scripted: tuple[ScriptedRuntime, Cri],
) -> None:
    """Each refusal swallows a request bigger than the connection window; kubelet is paid back for it."""
    runtime, cri = scripted
    for n in range(12):
        with pytest.raises(grpc.RpcError) as info:
            cri.runtime.CreateContainer(create_request(f"gpu-{n}", 200_000, wants_gpu=True), timeout=20)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"pod default/gpu-{n} container gpu-{n}" in info.value.details()
    assert runtime.created == []
    assert cri.runtime.Version(pb.VersionRequest(), timeout=5).runtime_name == "scripted"
    assert cri.runtime.CreateContainer(create_request("after", 10), timeout=5).container_id == "after"


def test_header_blocks_split_over_continuation_frames_are_followed(scripted: tuple[ScriptedRuntime, Cri]) -> None:
    runtime, cri = scripted
    big = Cri(cri.address, options=BIG)
    value = "v" * 40_000  # over one 16 KiB frame: HEADERS plus CONTINUATION
    big.runtime.Version(pb.VersionRequest(), timeout=5, metadata=(("x-large", value),))
    assert runtime.seen_metadata["x-large"] == value
    reply = big.runtime.CreateContainer(create_request("meta", 10), timeout=5, metadata=(("x-large", value),))
    assert reply.container_id == "meta" and len(runtime.created) == 1
    big.channel.close()


class RecordingRuntime:
    """A runtime socket that records the bytes the shim sends it; or, given ``last_words``, sends those
    and hangs up. One connection."""

    def __init__(self, path: Path, last_words: bytes = b"") -> None:
        self.path = path
        self.last_words = last_words
        self.received = bytearray()
        self.ended = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(str(path))
        self._listener.listen(1)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            if self.last_words:
                conn.sendall(self.last_words)
            else:
                while chunk := conn.recv(65536):
                    self.received += chunk
        self.ended.set()

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def recording(tmp_path: Path, start_shim: ShimFactory) -> Iterator[tuple[RecordingRuntime, str]]:
    runtime = RecordingRuntime(tmp_path / "recording.sock")
    yield runtime, start_shim(f"unix://{runtime.path}").shim.address.removeprefix("unix://")
    runtime.close()


def talk(address: str, data: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(address)
    sock.sendall(data)
    return sock


def test_a_client_that_does_not_speak_http2_is_cut_off_before_the_runtime_sees_a_byte(
    recording: tuple[RecordingRuntime, str],
) -> None:
    runtime, address = recording
    with talk(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") as sock:
        assert sock.recv(1024) == b""  # closed by the shim
    assert runtime.ended.wait(5) and runtime.received == b""


def test_frames_reach_the_runtime_byte_for_byte(recording: tuple[RecordingRuntime, str]) -> None:
    runtime, address = recording
    settings = frame(SETTINGS, 0, 0, b"\x00\x04\x00\x10\x00\x00")
    ping = frame(PING, 0, 0, b"12345678")
    unknown = frame(0xFA, 0x3, 0, b"an extension frame type")  # peers must ignore types they don't know
    sent = PREFACE + settings + ping + unknown
    with talk(address, sent):
        wait_until(lambda: len(runtime.received) >= len(sent), what="the frames at the runtime")
    assert runtime.received == sent


def test_what_the_runtime_said_before_hanging_up_still_reaches_kubelet(tmp_path: Path, start_shim: ShimFactory) -> None:
    """A runtime going away (GOAWAY, then close) while kubelet is slow to read: nothing relayed is lost."""
    last_words = b"".join(frame(0xFA, 0, 0, bytes([n]) * 16_000) for n in range(200))  # 3.2 MB peers ignore
    runtime = RecordingRuntime(tmp_path / "leaving.sock", last_words)
    address = start_shim(f"unix://{runtime.path}").shim.address.removeprefix("unix://")
    with talk(address, PREFACE) as sock:
        assert runtime.ended.wait(10)  # all written to the shim and gone, while we haven't read a byte
        received = bytearray()
        while chunk := sock.recv(1 << 20):
            received += chunk
    runtime.close()
    assert received == last_words


class FrameReader:
    """Frames as they arrive on a raw socket, read up to the one a test waits for."""

    def __init__(self, sock: socket.socket, skip: int = 0) -> None:
        self._sock, self._buf, self._pos = sock, b"", skip

    def until(self, wanted: Callable[[int, int, int], bool]) -> None:
        """Read until a frame whose (type, flags, stream) ``wanted`` accepts."""
        while True:
            while (found := frame_at(self._buf, self._pos)) is not None:
                self._pos, kind, flags, stream = found
                if wanted(kind, flags, stream):
                    return
            chunk = self._sock.recv(65536)
            assert chunk, "the connection closed first"
            self._buf += chunk


def test_a_held_call_the_runtime_resets_midway_holds_up_no_later_call(tmp_path: Path, start_shim: ShimFactory) -> None:
    """The runtime's stream window lets only part of a rewritten request through, then the runtime
    resets that stream (its deadline, say). The next CreateContainer must still reach it."""
    path = tmp_path / "raw-runtime.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(5)
        address = start_shim(f"unix://{path}").shim.address.removeprefix("unix://")
        encoder = Encoder()

        def call(stream: int, request: pb.CreateContainerRequest) -> bytes:
            block = encoder.encode([(":method", "POST"), (":path", "/runtime.v1.RuntimeService/CreateContainer")])
            message = grpc_message(request.SerializeToString())
            return frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream, message)

        with talk(address, PREFACE + frame(SETTINGS, 0, 0)) as kubelet:
            runtime, _ = listener.accept()
            with runtime:
                runtime.settimeout(5)
                window = SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + (20_000).to_bytes(4, "big")
                runtime.sendall(frame(SETTINGS, 0, 0, window))
                kubelet.sendall(call(1, create_request("big", 50_000)))  # 50 KB against a 20,000-byte window
                seen = FrameReader(runtime, skip=len(PREFACE))
                seen.until(lambda kind, _flags, stream: kind == DATA and stream == 1)
                runtime.sendall(rst_stream(1, ERROR_CANCEL))
                kubelet.sendall(call(3, create_request("small", 0)))
                seen.until(lambda kind, flags, stream: kind == DATA and stream == 3 and bool(flags & END_STREAM))
