"""A scripted NRI runtime for the plugin session's tests: it listens where containerd would, takes one
plugin connection at a time and plays the runtime's side of github.com/containerd/nri's
pkg/adaptation/plugin.go (serve ``Runtime`` on connection 2, call ``Plugin`` on connection 1), with
every step driven by the test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import Message
from gpushare.nriplugin.session import PLUGIN_SERVICE, RUNTIME_SERVICE

from gpushare.pb import nri_pb2
from gpushare.ttrpc.client import Client
from gpushare.ttrpc.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, Mux
from gpushare.ttrpc.server import Method, Server

Reply = TypeVar("Reply", bound=Message)


class PluginConnection:
    """One connected plugin, seen from the runtime."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.mux = Mux(reader, writer)
        self.client = Client(self.mux.open(PLUGIN_SERVICE_CONN))
        self.registered: asyncio.Future[nri_pb2.RegisterPluginRequest] = asyncio.get_running_loop().create_future()
        self.updates: asyncio.Queue[nri_pb2.UpdateContainersRequest] = asyncio.Queue()
        server = Server()
        server.register(
            RUNTIME_SERVICE,
            {
                "RegisterPlugin": Method(nri_pb2.RegisterPluginRequest, self._register),
                "UpdateContainers": Method(nri_pb2.UpdateContainersRequest, self._update),
            },
        )
        self._tasks = [
            asyncio.create_task(self.mux.run()),
            asyncio.create_task(self.client.run()),
            asyncio.create_task(server.serve(self.mux.open(RUNTIME_SERVICE_CONN))),
        ]

    async def _register(self, request: nri_pb2.RegisterPluginRequest) -> nri_pb2.Empty:
        self.registered.set_result(request)
        return nri_pb2.Empty()

    async def _update(self, request: nri_pb2.UpdateContainersRequest) -> nri_pb2.UpdateContainersResponse:
        await self.updates.put(request)
        return nri_pb2.UpdateContainersResponse(failed=[u for u in request.update if u.container_id == "gone"])

    async def call(self, method: str, request: Message, reply_type: type[Reply], timeout: float = 2.0) -> Reply:
        """``method`` of the plugin's Plugin service, with the runtime's request timeout."""
        return await self.client.call(PLUGIN_SERVICE, method, request, reply_type, timeout=timeout)

    async def configure(self, request_timeout_ms: int = 2000) -> int:
        """Configure, as containerd 2.2.9 sends it; the plugin's event mask."""
        request = nri_pb2.ConfigureRequest(
            runtime_name="fake-runtime",
            runtime_version="v0",
            registration_timeout=5000,
            request_timeout=request_timeout_ms,
        )
        return (await self.call("Configure", request, nri_pb2.ConfigureResponse)).events

    async def close(self) -> None:
        self.mux.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class FakeRuntime:
    """Listens on ``socket``; :meth:`accept` hands over each plugin that connects."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self._connections: asyncio.Queue[PluginConnection] = asyncio.Queue()
        self._open: list[PluginConnection] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accepted, str(self.socket))

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = PluginConnection(reader, writer)
        self._open.append(connection)
        await self._connections.put(connection)

    async def accept(self, timeout: float = 5.0) -> PluginConnection:
        """The next plugin to connect, once it registered."""
        async with asyncio.timeout(timeout):
            connection = await self._connections.get()
            await connection.registered
        return connection

    async def stop(self) -> None:
        """Stop listening and close every plugin connection, as a stopping containerd does."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for connection in self._open:
            await connection.close()
        self._open.clear()
        if server is not None:
            await server.wait_closed()
        self.socket.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def fake_runtime(socket: Path) -> AsyncIterator[FakeRuntime]:
    runtime = FakeRuntime(socket)
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()
