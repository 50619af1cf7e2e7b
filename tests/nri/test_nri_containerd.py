"""The NRI plugin session against a real containerd 2.2.9 (NRI v0.11.0, ttRPC v1.2.7): pods and
containers are made through CRI as kubelet makes them, and what the plugin answers is what the
container really gets (read back with ExecSync and the runtime spec)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from gpushare.draplugin.cdi import write_spec
from gpushare.nriplugin.session import HANDLED_EVENTS, ContainerRefused, Runtime, run_forever, run_session

from gpushare.kube.retry import Backoff
from gpushare.memlimits.cgroups import cgroup_dir, detect_layout
from gpushare.pb import cri_pb2 as cri
from gpushare.pb import nri_pb2
from gpushare.sandbox import cri_kubelet
from gpushare.sandbox.containerd import TEST_IMAGE, Containerd, containerd_available

pytestmark = pytest.mark.skipif(containerd_available() is not None, reason=str(containerd_available()))

Decision = Callable[[nri_pb2.CreateContainerRequest], nri_pb2.CreateContainerResponse]


def no_change(_: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
    return nri_pb2.CreateContainerResponse()


class Observer:
    """A PluginHandler that reports each call to the test thread and answers CreateContainer with
    ``decide``."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.decide: Decision = no_change
        #: never answer CreateContainer (the session's deadline answers instead)
        self.stall = False
        #: refuse each StartContainer with this, when set
        self.refuse_start = ""
        self.runtime: Runtime | None = None

    async def configure(self, request: nri_pb2.ConfigureRequest, runtime: Runtime) -> Collection[int]:
        self.runtime = runtime
        self.calls.put(("configure", request))
        return HANDLED_EVENTS

    async def synchronize(
        self, pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container]
    ) -> Sequence[nri_pb2.ContainerUpdate]:
        self.calls.put(("synchronize", (list(pods), list(containers))))
        return []

    async def create_container(self, request: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        self.calls.put(("create", request))
        if self.stall:
            await asyncio.Event().wait()
        return self.decide(request)

    async def start_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container) -> None:
        self.calls.put(("start", (container, _cgroup_exists(container.linux.cgroups_path))))
        if self.refuse_start:
            raise ContainerRefused(self.refuse_start)

    async def stop_pod_sandbox(self, pod: nri_pb2.PodSandbox) -> None:
        self.calls.put(("stop", pod))

    async def remove_pod_sandbox(self, pod: nri_pb2.PodSandbox) -> None:
        self.calls.put(("remove", pod))

    async def shutdown(self) -> None:
        self.calls.put(("shutdown", None))

    def next(self, kind: str, timeout: float = 20.0) -> Any:
        """The next call of ``kind`` (earlier calls of other kinds are passed over)."""
        while True:
            try:
                seen, payload = self.calls.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"the plugin got no {kind} call within {timeout}s") from None
            if seen == kind:
                return payload


class PluginThread:
    """One plugin session on an event loop of its own, beside the test's blocking CRI calls."""

    def __init__(self, socket: Path, observer: Observer, forever: bool = False) -> None:
        self.observer = observer
        self.loop = asyncio.new_event_loop()
        self.session: Future[None] = Future()
        session = (
            run_forever(socket, "gpushare-test", "50", observer, Backoff(initial=0.2, maximum=1.0))
            if forever
            else run_session(socket, "gpushare-test", "50", observer)
        )
        self._task = self.loop.create_task(session)
        self._task.add_done_callback(self._ended)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.wait([self._task]))
        self.loop.close()

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            self.session.cancel()
        elif (failure := task.exception()) is not None:
            self.session.set_exception(failure)
        else:
            self.session.set_result(None)

    def call_runtime(self, **update: Any) -> list[nri_pb2.ContainerUpdate]:
        """``Runtime.update_containers(**update)`` from the plugin's loop."""
        assert self.observer.runtime is not None
        running = asyncio.run_coroutine_threadsafe(self.observer.runtime.update_containers(**update), self.loop)
        return running.result(timeout=20)

    def disconnect(self) -> None:
        """Cancel the session (the plugin goes away) and wait for its thread."""
        with contextlib.suppress(RuntimeError):  # the loop already closed: the session had ended
            self.loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=20)
        assert not self._thread.is_alive()


@pytest.fixture
def plugin(containerd: Containerd) -> Iterator[Callable[..., PluginThread]]:
    started: list[PluginThread] = []

    def start(forever: bool = False) -> PluginThread:
        thread = PluginThread(containerd.nri_socket, Observer(), forever)
        started.append(thread)
        thread.observer.next("configure")
        return thread

    yield start
    for thread in started:
        thread.disconnect()


# --- kubelet's side ---------------------------------------------------------------------------------------


def pod(name: str) -> cri.PodSandboxConfig:
    """A pod's sandbox as kubelet (cgroupfs driver) asks for it."""
    config = cri_kubelet.sandbox_config(
        {"metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}", "labels": {"app": name}}}
    )
    config.linux.cgroup_parent = f"/gpushare-nri-test/pod-uid-{name}"
    return config


def create(runtime: cri_kubelet.CriRuntime, sandbox: cri.PodSandboxConfig, name: str, **env: str) -> str:
    """Run ``sandbox`` (once) and create and start container ``name`` in it; the container's id."""
    sandboxes = runtime.runtime.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items
    existing = [s.id for s in sandboxes if s.metadata.uid == sandbox.metadata.uid and s.state == cri.SANDBOX_READY]
    sandbox_id = (
        existing[0]
        if existing
        else runtime.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox), timeout=60).pod_sandbox_id
    )
    config = cri_kubelet.container_config(
        {"metadata": {"name": sandbox.metadata.name, "namespace": sandbox.metadata.namespace}},
        {"name": name, "env": [{"name": k, "value": v} for k, v in env.items()]},
        None,
        TEST_IMAGE,
    )
    config.annotations["team-a.example/owner"] = "kubelet"
    container_id = runtime.runtime.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox), timeout=60
    ).container_id
    runtime.runtime.StartContainer(cri.StartContainerRequest(container_id=container_id), timeout=60)
    return container_id


def runtime_spec(runtime: cri_kubelet.CriRuntime, container_id: str) -> dict[str, Any]:
    status = runtime.runtime.ContainerStatus(
        cri.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=30
    )
    return json.loads(status.info["info"])["runtimeSpec"]


def state(runtime: cri_kubelet.CriRuntime, container_id: str) -> int:
    status = runtime.runtime.ContainerStatus(cri.ContainerStatusRequest(container_id=container_id), timeout=30)
    return status.status.state


def _cgroup_exists(cgroups_path: str) -> bool | None:
    """Whether the cgroup a runtime spec names exists in the cgroup v2 hierarchy (None: there is none)."""
    unified = detect_layout(Path("/proc/self/mountinfo").read_text()).unified
    return None if unified is None else cgroup_dir(unified, cgroups_path).is_dir()


# --- the tests --------------------------------------------------------------------------------------------


def test_a_plugin_is_synchronised_then_adjusts_every_new_container(
    crictl: cri_kubelet.CriRuntime, plugin: Callable[..., PluginThread]
) -> None:
    before = create(crictl, pod("early"), "first")
    session = plugin()
    observer = session.observer
    pods, containers = observer.next("synchronize")
    assert "uid-early" in [p.uid for p in pods]
    assert before in [c.id for c in containers]
    assert next(c for c in containers if c.id == before).state == nri_pb2.CONTAINER_RUNNING

    def adjust(request: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        return nri_pb2.CreateContainerResponse(
            adjust=nri_pb2.ContainerAdjustment(
                env=[
                    nri_pb2.KeyValue(key="GPUSHARE_NRI", value=f"{request.pod.namespace}/{request.container.name}"),
                    nri_pb2.KeyValue(key="REPLACE_ME", value="plugin"),
                    nri_pb2.KeyValue(key="-DROP_ME"),
                ],
                annotations={"gpushare.io/nri": "adjusted"},
            )
        )

    observer.decide = adjust
    created = create(crictl, pod("late"), "app", REPLACE_ME="kubelet", DROP_ME="1")
    request = observer.next("create")
    assert (request.pod.name, request.pod.namespace, request.pod.uid) == ("late", "team-a", "uid-late")
    assert request.pod.labels["app"] == "late"
    assert request.pod.linux.cgroup_parent == "/gpushare-nri-test/pod-uid-late"
    assert request.container.name == "app"
    assert {"REPLACE_ME=kubelet", "DROP_ME=1"} <= set(request.container.env)
    assert request.container.annotations["team-a.example/owner"] == "kubelet"
    assert request.container.linux.cgroups_path
    env = crictl.process_env(created)
    assert env["GPUSHARE_NRI"] == "team-a/app" and env["REPLACE_ME"] == "plugin"
    # NRI v0.11 merges the plugins' adjustments without their env removals (pkg/adaptation/result.go,
    # adjustEnv): a removal only undoes an earlier plugin's addition, never the container's own variable
    assert env["DROP_ME"] == "1"
    assert runtime_spec(crictl, created)["annotations"]["gpushare.io/nri"] == "adjusted"

    crictl.runtime.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=request.pod.id), timeout=60)
    assert observer.next("stop").uid == "uid-late"
    crictl.runtime.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=request.pod.id), timeout=60)
    assert observer.next("remove").uid == "uid-late"


def test_devices_and_cdi_devices_of_an_adjustment_reach_the_container(
    containerd: Containerd, crictl: cri_kubelet.CriRuntime, plugin: Callable[..., PluginThread]
) -> None:
    write_spec(
        containerd.base / "cdi",
        "nri-test",
        {
            "cdiVersion": "0.6.0",
            "kind": "gpushare.test/nri",
            "devices": [{"name": "one", "containerEdits": {"env": ["CDI_SEEN=one"]}}],
        },
    )
    observer = plugin().observer
    null = nri_pb2.LinuxDevice(
        path="/dev/gpushare-null", type="c", major=1, minor=3, file_mode=nri_pb2.OptionalFileMode(value=0o666)
    )
    observer.decide = lambda _: nri_pb2.CreateContainerResponse(
        adjust=nri_pb2.ContainerAdjustment(
            linux=nri_pb2.LinuxContainerAdjustment(devices=[null]),
            CDI_devices=[nri_pb2.CDIDevice(name="gpushare.test/nri=one")],
        )
    )
    created = create(crictl, pod("devices"), "app")
    assert crictl.process_env(created)["CDI_SEEN"] == "one"
    # the node exists and the device cgroup lets the container open it
    readable = ["sh", "-c", "test -c /dev/gpushare-null && cat /dev/gpushare-null"]
    probe = crictl.runtime.ExecSync(cri.ExecSyncRequest(container_id=created, cmd=readable), timeout=30)
    assert probe.exit_code == 0, probe.stderr
    devices = runtime_spec(crictl, created)["linux"]["devices"]
    assert {"path": "/dev/gpushare-null", "type": "c", "major": 1, "minor": 3} in [
        {k: d[k] for k in ("path", "type", "major", "minor")} for d in devices
    ]


def test_a_refusal_fails_the_container_with_the_plugins_words(
    crictl: cri_kubelet.CriRuntime, plugin: Callable[..., PluginThread]
) -> None:
    observer = plugin().observer

    def refuse(request: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        raise ContainerRefused(f"{request.container.name} asks for a card this node lacks")

    observer.decide = refuse
    with pytest.raises(grpc.RpcError) as refused:
        create(crictl, pod("refused"), "greedy")
    # containerd keeps the plugin's status code and wraps its message
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == (
        "failed to create containerd container: failed to get NRI adjustment for container: "
        "rpc error: code = FailedPrecondition desc = greedy asks for a card this node lacks"
    )
    observer.decide = no_change
    create(crictl, pod("refused"), "modest")


def test_evictions_are_dropped_by_this_runtime_whichever_way_they_are_sent(
    crictl: cri_kubelet.CriRuntime, plugin: Callable[..., PluginThread]
) -> None:
    """NRI v0.11's runtime side passes on only the updates of UpdateContainers, and merges the plugins'
    CreateContainer answers without their evictions (pkg/adaptation/plugin.go and result.go), so
    containerd 2.2.9 stops nothing a plugin evicts. Both calls are synchronous: had an eviction been
    applied, the container would be stopped by the time the call returned."""
    session = plugin()
    victim = create(crictl, pod("victim"), "hog")
    assert session.call_runtime(evictions=[nri_pb2.ContainerEviction(container_id=victim, reason="over")]) == []
    assert state(crictl, victim) == cri.CONTAINER_RUNNING

    def evict(_: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        return nri_pb2.CreateContainerResponse(
            evict=[nri_pb2.ContainerEviction(container_id=victim, reason="make room")]
        )

    session.observer.decide = evict
    create(crictl, pod("newcomer"), "app")
    assert state(crictl, victim) == cri.CONTAINER_RUNNING
    # what does reach the runtime: an update of the container's resources
    limit = nri_pb2.LinuxResources(memory=nri_pb2.LinuxMemory(limit=nri_pb2.OptionalInt64(value=256 << 20)))
    update = nri_pb2.ContainerUpdate(container_id=victim, linux=nri_pb2.LinuxContainerUpdate(resources=limit))
    assert session.call_runtime(updates=[update]) == []
    status = crictl.runtime.ContainerStatus(cri.ContainerStatusRequest(container_id=victim), timeout=30).status
    assert status.resources.linux.memory_limit_in_bytes == 256 << 20


def test_once_the_plugin_is_gone_containers_are_created_without_it(
    crictl: cri_kubelet.CriRuntime, plugin: Callable[..., PluginThread]
) -> None:
    session = plugin()
    session.observer.decide = lambda _: nri_pb2.CreateContainerResponse(
        adjust=nri_pb2.ContainerAdjustment(env=[nri_pb2.KeyValue(key="GPUSHARE_NRI", value="yes")])
    )
    assert crictl.process_env(create(crictl, pod("with"), "app"))["GPUSHARE_NRI"] == "yes"
    session.disconnect()
    assert session.session.cancelled()
    assert "GPUSHARE_NRI" not in crictl.process_env(create(crictl, pod("without"), "app"))
    calls = [session.observer.calls.get_nowait()[0] for _ in range(session.observer.calls.qsize())]
    # the handler heard of the session's end (it enforces nothing from then on), and of nothing after
    assert calls == ["synchronize", "create", "start", "shutdown"]


def test_a_handler_that_cannot_decide_in_time_refuses_the_container_and_stays_connected(
    crictl: cri_kubelet.CriRuntime, plugin: Callable[..., PluginThread]
) -> None:
    """Past plugin_request_timeout containerd would drop the plugin and create the container unadjusted;
    the session answers shortly before it instead."""
    observer = plugin().observer
    observer.stall = True
    with pytest.raises(grpc.RpcError) as refused:
        create(crictl, pod("slow"), "app")
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert refused.value.details().endswith("NRI plugin 50-gpushare-test did not answer CreateContainer within 1.75s")
    observer.stall = False
    observer.decide = lambda _: nri_pb2.CreateContainerResponse(
        adjust=nri_pb2.ContainerAdjustment(env=[nri_pb2.KeyValue(key="GPUSHARE_NRI", value="still here")])
    )
    assert crictl.process_env(create(crictl, pod("slow"), "app"))["GPUSHARE_NRI"] == "still here"


def test_run_forever_comes_back_after_containerd_restarts(
    containerd: Containerd, crictl: cri_kubelet.CriRuntime, plugin: Callable[..., PluginThread]
) -> None:
    session = plugin(forever=True)
    session.observer.next("synchronize")
    running = create(crictl, pod("through-restart"), "app")
    containerd.restart()
    session.observer.next("configure")
    pods, containers = session.observer.next("synchronize")
    assert "uid-through-restart" in [p.uid for p in pods] and running in [c.id for c in containers]
    session.observer.decide = lambda _: nri_pb2.CreateContainerResponse(
        adjust=nri_pb2.ContainerAdjustment(env=[nri_pb2.KeyValue(key="GPUSHARE_NRI", value="again")])
    )
    assert crictl.process_env(create(crictl, pod("after-restart"), "app"))["GPUSHARE_NRI"] == "again"
    assert not session.session.done()


def test_start_comes_when_the_containers_cgroup_exists_and_a_refusal_fails_the_start(
    crictl: cri_kubelet.CriRuntime, plugin: Callable[..., PluginThread]
) -> None:
    """containerd 2.2 makes the task (runc create: the cgroup, with runc's init waiting in it), sends
    StartContainer, then starts the task; NRI v0.11 hands a plugin's error back, which fails the start."""
    observer = plugin().observer
    started = create(crictl, pod("starts"), "first")
    container, cgroup_there = observer.next("start")
    assert container.id == started and container.linux.cgroups_path
    assert cgroup_there is not False, f"cgroup {container.linux.cgroups_path} did not exist at StartContainer"
    assert state(crictl, started) == cri.CONTAINER_RUNNING

    observer.refuse_start = "second may not start unlimited"
    with pytest.raises(grpc.RpcError) as refused:
        create(crictl, pod("starts"), "second")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "second may not start unlimited" in refused.value.details()
    (second,) = [
        c.id
        for c in crictl.runtime.ListContainers(cri.ListContainersRequest(), timeout=30).containers
        if c.metadata.name == "second"
    ]
    assert state(crictl, second) != cri.CONTAINER_RUNNING  # its process never ran
