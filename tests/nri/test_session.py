"""The NRI plugin session against a scripted runtime: registration, configuration, synchronisation, the
answers the runtime gets for each event, and reconnecting."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from gpushare.nriplugin.session import (
    HANDLED_EVENTS,
    ContainerRefused,
    Runtime,
    SessionRefused,
    event_mask,
    run_forever,
    run_session,
)
from support.nriruntime import PluginConnection, fake_runtime

from gpushare.kube.retry import Backoff
from gpushare.pb import nri_pb2
from gpushare.ttrpc.errors import RemoteError


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), 20))


@pytest.fixture
def socket_path() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="nri", dir="/tmp"))  # unix socket paths must stay short
    yield directory / "nri.sock"
    shutil.rmtree(directory, ignore_errors=True)


class Recorder:
    """A PluginHandler that records what it was given and answers as the test sets it."""

    def __init__(self, events: Collection[int] = HANDLED_EVENTS) -> None:
        self.events = events
        self.runtime: Runtime | None = None
        self.synced: asyncio.Future[tuple[list[str], list[str]]] = asyncio.get_running_loop().create_future()
        self.notified: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.create: Callable[[nri_pb2.CreateContainerRequest], Awaitable[nri_pb2.CreateContainerResponse]] = (
            self.adjust
        )
        self.fail_notifications = False
        #: refuse StartContainer with this, when set
        self.refuse_start = ""

    async def configure(self, request: nri_pb2.ConfigureRequest, runtime: Runtime) -> Collection[int]:
        self.runtime = runtime
        return self.events

    async def synchronize(
        self, pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container]
    ) -> Sequence[nri_pb2.ContainerUpdate]:
        self.synced.set_result(([p.id for p in pods], [c.id for c in containers]))
        return [nri_pb2.ContainerUpdate(container_id=c.id) for c in containers[:1]]

    async def create_container(self, request: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        return await self.create(request)

    @staticmethod
    async def adjust(request: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        return nri_pb2.CreateContainerResponse(
            adjust=nri_pb2.ContainerAdjustment(env=[nri_pb2.KeyValue(key="SEEN", value=request.container.name)])
        )

    async def start_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container) -> None:
        await self.notified.put(("start", container.name))
        if self.refuse_start:
            raise ContainerRefused(self.refuse_start)

    async def stop_pod_sandbox(self, pod: nri_pb2.PodSandbox) -> None:
        await self._notified("stop", pod)

    async def remove_pod_sandbox(self, pod: nri_pb2.PodSandbox) -> None:
        await self._notified("remove", pod)

    async def shutdown(self) -> None:
        await self.notified.put(("shutdown", ""))

    async def _notified(self, what: str, pod: nri_pb2.PodSandbox) -> None:
        await self.notified.put((what, pod.uid))
        if self.fail_notifications:
            raise RuntimeError("the handler broke")


def creation(name: str = "app") -> nri_pb2.CreateContainerRequest:
    return nri_pb2.CreateContainerRequest(
        pod=nri_pb2.PodSandbox(id="sb1", name="pod", uid="uid-1", namespace="ns"),
        container=nri_pb2.Container(id="c1", pod_sandbox_id="sb1", name=name),
    )


def test_a_session_registers_configures_and_synchronises(socket_path: Path) -> None:
    async def scenario() -> None:
        handler = Recorder()
        async with fake_runtime(socket_path) as runtime:
            session = asyncio.create_task(run_session(socket_path, "gpushare", "10", handler))
            connection = await runtime.accept()
            assert connection.registered.result() == nri_pb2.RegisterPluginRequest(
                plugin_name="gpushare", plugin_idx="10"
            )
            mask = await connection.configure()
            assert mask == event_mask(HANDLED_EVENTS) == 0b101110
            # the runtime splits the state over two requests; the handler sees it once, whole
            more = nri_pb2.SynchronizeRequest(
                pods=[nri_pb2.PodSandbox(id="p1")], containers=[nri_pb2.Container(id="c1")], more=True
            )
            assert await connection.call("Synchronize", more, nri_pb2.SynchronizeResponse) == (
                nri_pb2.SynchronizeResponse(more=True)
            )
            assert not handler.synced.done()
            last = nri_pb2.SynchronizeRequest(
                pods=[nri_pb2.PodSandbox(id="p2")], containers=[nri_pb2.Container(id="c2")]
            )
            reply = await connection.call("Synchronize", last, nri_pb2.SynchronizeResponse)
            assert await handler.synced == (["p1", "p2"], ["c1", "c2"])
            assert [u.container_id for u in reply.update] == ["c1"] and not reply.more
            # the runtime closing the connection ends the session without an error, and the handler hears
            # of it (the node agent's readiness goes false until the next session)
            assert handler.notified.empty()
            await connection.close()
            await session
            assert handler.notified.get_nowait() == ("shutdown", "")

    run(scenario)


def test_create_container_answers_with_the_handlers_adjustment_or_refusal(socket_path: Path) -> None:
    async def scenario() -> None:
        handler = Recorder()
        async with fake_runtime(socket_path) as runtime:
            session = asyncio.create_task(run_session(socket_path, "gpushare", "10", handler))
            connection = await runtime.accept()
            await connection.configure(request_timeout_ms=1000)
            reply = await connection.call("CreateContainer", creation("web"), nri_pb2.CreateContainerResponse)
            assert list(reply.adjust.env) == [nri_pb2.KeyValue(key="SEEN", value="web")]

            async def refuse(_: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
                raise ContainerRefused("pod ns/pod asks for more GPU memory than its card has")

            async def crash(_: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
                raise KeyError("cards")

            async def dawdle(_: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

            expected = {
                refuse: (grpc.StatusCode.FAILED_PRECONDITION, "pod ns/pod asks for more GPU memory than its card has"),
                crash: (grpc.StatusCode.INTERNAL, "NRI plugin 10-gpushare failed: KeyError('cards')"),
                # answered before the runtime's 1 s timeout, which would drop the plugin and let the container through
                dawdle: (
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "NRI plugin 10-gpushare did not answer CreateContainer within 0.75s",
                ),
            }
            for create, (code, message) in expected.items():
                handler.create = create
                with pytest.raises(RemoteError) as refused:
                    await connection.call("CreateContainer", creation(), nri_pb2.CreateContainerResponse, timeout=1.0)
                assert (refused.value.code, refused.value.message) == (code, message)
            await connection.close()
            await session

    run(scenario)


def test_pod_events_reach_the_handler_and_its_failures_are_not_the_runtimes(socket_path: Path) -> None:
    async def scenario() -> None:
        handler = Recorder()
        async with fake_runtime(socket_path) as runtime:
            session = asyncio.create_task(run_session(socket_path, "gpushare", "10", handler))
            connection = await runtime.accept()
            await connection.configure()
            pod = nri_pb2.PodSandbox(id="sb1", uid="uid-1")
            for event, failing in ((nri_pb2.STOP_POD_SANDBOX, False), (nri_pb2.REMOVE_POD_SANDBOX, True)):
                handler.fail_notifications = failing
                change = nri_pb2.StateChangeEvent(event=event, pod=pod)
                assert await connection.call("StateChange", change, nri_pb2.Empty) == nri_pb2.Empty()
            # an event the handler has no method for is answered without reaching it
            started = nri_pb2.StateChangeEvent(event=nri_pb2.POST_START_CONTAINER, pod=pod)
            assert await connection.call("StateChange", started, nri_pb2.Empty) == nri_pb2.Empty()
            # a container's start is the handler's to refuse: its refusal is the runtime's error
            ctr = nri_pb2.Container(id="c1", name="app")
            start = nri_pb2.StateChangeEvent(event=nri_pb2.START_CONTAINER, pod=pod, container=ctr)
            assert await connection.call("StateChange", start, nri_pb2.Empty) == nri_pb2.Empty()
            handler.refuse_start = "app may not start unlimited"
            with pytest.raises(RemoteError, match="app may not start unlimited"):
                await connection.call("StateChange", start, nri_pb2.Empty)
            assert await connection.call("Shutdown", nri_pb2.Empty(), nri_pb2.Empty) == nri_pb2.Empty()
            seen = [handler.notified.get_nowait() for _ in range(handler.notified.qsize())]
            assert seen == [
                ("stop", "uid-1"),
                ("remove", "uid-1"),
                ("start", "app"),
                ("start", "app"),
                ("shutdown", ""),
            ]
            await connection.close()
            await session

    run(scenario)


def test_the_handler_calls_the_runtime_through_the_session(socket_path: Path) -> None:
    async def scenario() -> None:
        handler = Recorder()
        async with fake_runtime(socket_path) as runtime:
            session = asyncio.create_task(run_session(socket_path, "gpushare", "10", handler))
            connection = await runtime.accept()
            await connection.configure()
            assert handler.runtime is not None
            failed = await handler.runtime.update_containers(
                [nri_pb2.ContainerUpdate(container_id="gone")],
                [nri_pb2.ContainerEviction(container_id="c9", reason="over its GPU memory")],
            )
            assert [u.container_id for u in failed] == ["gone"]
            request = connection.updates.get_nowait()
            assert [(e.container_id, e.reason) for e in request.evict] == [("c9", "over its GPU memory")]
            await connection.close()
            await session

    run(scenario)


@pytest.mark.parametrize(
    ("events", "why"),
    [
        ({nri_pb2.CREATE_CONTAINER, nri_pb2.POST_START_CONTAINER}, "events it has no method for: POST_START_CONTAINER"),
        (set(), "subscribed to nothing"),
    ],
)
def test_a_subscription_the_session_cannot_serve_is_refused(socket_path: Path, events: set[int], why: str) -> None:
    async def scenario() -> None:
        async with fake_runtime(socket_path) as runtime:
            session = asyncio.create_task(run_session(socket_path, "gpushare", "10", Recorder(events)))
            connection = await runtime.accept()
            with pytest.raises(RemoteError, match=why):
                await connection.configure()
            # the runtime drops a plugin it couldn't configure
            await connection.close()
            with pytest.raises(SessionRefused, match=f"before configuring it: .*{why}"):
                await session

    run(scenario)


def test_a_bad_index_is_refused_before_connecting(socket_path: Path) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="'1a' is not two digits"):
            await run_session(socket_path, "gpushare", "1a", Recorder())

    run(scenario)


def test_run_forever_waits_for_the_socket_and_comes_back_after_a_restart(socket_path: Path) -> None:
    async def scenario() -> None:
        handler = Recorder()
        plugin = asyncio.create_task(
            run_forever(socket_path, "gpushare", "10", handler, Backoff(initial=0.01, maximum=0.05))
        )
        try:
            for _ in range(2):  # containerd starts after the plugin, then restarts
                async with fake_runtime(socket_path) as runtime:
                    connection: PluginConnection = await runtime.accept()
                    assert await connection.configure() == event_mask(HANDLED_EVENTS)
                    reply = await connection.call("CreateContainer", creation(), nri_pb2.CreateContainerResponse)
                    assert reply.adjust.env[0].value == "app"
            assert not plugin.done()
        finally:
            plugin.cancel()
            with pytest.raises(asyncio.CancelledError):
                await plugin

    run(scenario)
