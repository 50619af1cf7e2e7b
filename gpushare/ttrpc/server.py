"""A ttRPC server on one channel, following github.com/containerd/ttrpc v1.2.7's server.go and
services.go: requests are dispatched by (service, method) to async handlers, each request on a task
of its own, and every answer is a ``ttrpc.Response`` on the request's stream.

What a client gets wrong is answered, not fatal, as upstream answers it: an even stream id (clients
use odd ones), a stream id not above the last one, an unknown service or method (UNIMPLEMENTED), a
payload that doesn't parse, an oversized message (RESOURCE_EXHAUSTED; it is read past). Data messages
(streaming calls) aren't served: NRI doesn't use them. A handler's :class:`Status` becomes the answer's
status; any other exception becomes UNKNOWN with its text, as ttRPC's convertCode does for an error it
doesn't recognise. A request's ``timeout_nano`` bounds its handler; when the channel ends, handlers
still running are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from gpushare.pb import ttrpc_pb2
from gpushare.ttrpc.errors import ConnectionLost, OversizedMessage, Status
from gpushare.ttrpc.framing import Channel, Header, MessageType, encode, read_message

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[Message]]
#: an error status's text is cut to this many characters, so that no answer outgrows a message
_MESSAGE_TEXT = 1 << 16


@dataclass(frozen=True, slots=True)
class Method:
    """One served method: the request message type to parse and the handler that answers it."""

    request_type: type[Message]
    handler: Handler


class Server:
    """Serves registered methods on channels (one :meth:`serve` per channel)."""

    def __init__(self) -> None:
        self._services: dict[str, dict[str, Method]] = {}

    def register(self, service: str, methods: dict[str, Method]) -> None:
        """Serve ``methods`` under ``service``, the protobuf service's full name."""
        if service in self._services:
            raise ValueError(f"service {service} is already registered")
        self._services[service] = dict(methods)

    async def serve(self, channel: Channel) -> None:
        """Answer requests on ``channel`` until it ends (returns) or breaks (raises)."""
        calls: set[asyncio.Task[None]] = set()
        last_stream = 0
        try:
            while True:
                try:
                    header, payload = await read_message(channel.reader)
                except ConnectionLost:
                    return
                refusal = _refusal(header, payload is None, last_stream)
                if refusal is not None:
                    await self._answer(channel, header.stream_id, refusal)
                    continue
                assert payload is not None
                last_stream = header.stream_id
                call = asyncio.create_task(self._call(channel, header.stream_id, payload))
                calls.add(call)
                call.add_done_callback(calls.discard)
        finally:
            for call in calls:
                call.cancel()

    async def _call(self, channel: Channel, stream_id: int, payload: bytes) -> None:
        try:
            reply = await self._dispatch(payload)
        except Status as status:
            await self._answer(channel, stream_id, status)
        except Exception as exc:
            log.exception("ttrpc handler failed on stream %d", stream_id)
            await self._answer(channel, stream_id, Status(grpc.StatusCode.UNKNOWN, str(exc) or type(exc).__name__))
        else:
            try:
                message = encode(stream_id, MessageType.RESPONSE, ttrpc_pb2.Response(payload=reply).SerializeToString())
            except OversizedMessage as exc:
                await self._answer(channel, stream_id, Status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)))
                return
            await self._send(channel, stream_id, message)

    async def _dispatch(self, payload: bytes) -> bytes:
        request = ttrpc_pb2.Request()
        try:
            request.ParseFromString(payload)
        except DecodeError as exc:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"the request envelope doesn't parse: {exc}") from None
        service = self._services.get(request.service)
        if service is None:
            raise Status(grpc.StatusCode.UNIMPLEMENTED, f"service {request.service}")
        method = service.get(request.method)
        if method is None:
            raise Status(grpc.StatusCode.UNIMPLEMENTED, f"method {request.method}")
        argument = method.request_type()
        try:
            argument.ParseFromString(request.payload)
        except DecodeError as exc:
            raise Status(
                grpc.StatusCode.INTERNAL, f"{request.service}/{request.method}: the payload doesn't parse: {exc}"
            ) from None
        deadline = request.timeout_nano / 1e9 if request.timeout_nano > 0 else None
        try:
            async with asyncio.timeout(deadline):
                reply = await method.handler(argument)
        except TimeoutError:
            raise Status(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"{request.service}/{request.method} ran past the caller's deadline"
            ) from None
        return reply.SerializeToString()

    async def _answer(self, channel: Channel, stream_id: int, status: Status) -> None:
        response = ttrpc_pb2.Response(
            status=ttrpc_pb2.Status(code=status.number, message=status.message[:_MESSAGE_TEXT])
        )
        await self._send(channel, stream_id, encode(stream_id, MessageType.RESPONSE, response.SerializeToString()))

    @staticmethod
    async def _send(channel: Channel, stream_id: int, message: bytes) -> None:
        try:
            await channel.send(message)
        except ConnectionLost:
            log.debug("ttrpc answer on stream %d not sent: the connection is gone", stream_id)


def _refusal(header: Header, oversized: bool, last_stream: int) -> Status | None:
    """Why a message can't start a call (upstream's order of checks), or None when it can."""
    if oversized:
        return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"message of {header.length} bytes is too long")
    if header.stream_id % 2 != 1:
        return Status(grpc.StatusCode.INVALID_ARGUMENT, "stream ids of client requests must be odd")
    if header.type != MessageType.REQUEST:
        return Status(grpc.StatusCode.INVALID_ARGUMENT, f"{header.type.name.lower()} messages aren't served")
    if header.stream_id <= last_stream:
        return Status(grpc.StatusCode.INVALID_ARGUMENT, "stream ids must increase and can't be reused")
    return None
