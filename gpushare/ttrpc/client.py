"""A ttRPC client on one channel, following github.com/containerd/ttrpc v1.2.7's client.go: each call
takes the next odd stream id (1, 3, 5, ...), sends a ``ttrpc.Request`` on it and waits for the
``ttrpc.Response`` on the same stream, so that any number of calls run at once. A deadline travels
in ``timeout_nano`` and bounds the wait here too.

:meth:`Client.run` reads the responses; when the channel ends, every call still waiting fails with
:class:`ConnectionLost`, and so does every later call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from gpushare.pb import ttrpc_pb2
from gpushare.ttrpc.errors import ConnectionLost, ProtocolError, RemoteError
from gpushare.ttrpc.framing import Channel, MessageType, encode, read_message

log = logging.getLogger(__name__)

Reply = TypeVar("Reply", bound=Message)


class Client:
    """Calls over ``channel``; :meth:`run` must be running for answers to arrive."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._streams = itertools.count(1, 2)
        self._waiting: dict[int, asyncio.Future[ttrpc_pb2.Response]] = {}
        self._ended: Exception | None = None

    async def call(
        self, service: str, method: str, request: Message, reply_type: type[Reply], timeout: float | None = None
    ) -> Reply:
        """``service``/``method`` with ``request``; the peer's reply parsed as ``reply_type``. Raises
        :class:`RemoteError` for an error status, :class:`TimeoutError` past ``timeout`` seconds."""
        if self._ended is not None:
            raise ConnectionLost(f"the connection has ended: {self._ended}")
        stream_id = next(self._streams)
        envelope = ttrpc_pb2.Request(
            service=service,
            method=method,
            payload=request.SerializeToString(),
            timeout_nano=int(timeout * 1e9) if timeout is not None else 0,
        )
        answer: asyncio.Future[ttrpc_pb2.Response] = asyncio.get_running_loop().create_future()
        self._waiting[stream_id] = answer
        try:
            await self._channel.send(encode(stream_id, MessageType.REQUEST, envelope.SerializeToString()))
            async with asyncio.timeout(timeout):
                response = await answer
        finally:
            self._waiting.pop(stream_id, None)
        if response.HasField("status") and response.status.code != 0:
            raise RemoteError.from_wire(response.status.code, response.status.message)
        reply = reply_type()
        try:
            reply.ParseFromString(response.payload)
        except DecodeError as exc:
            raise ProtocolError(
                f"the reply to {service}/{method} doesn't parse as {reply_type.__name__}: {exc}"
            ) from None
        return reply

    async def run(self) -> None:
        """Hand each response to its call until the channel ends (returns) or breaks (raises)."""
        try:
            while True:
                header, payload = await read_message(self._channel.reader)
                if header.type != MessageType.RESPONSE:
                    raise ProtocolError(f"a {header.type.name.lower()} message on stream {header.stream_id}")
                answer = self._waiting.get(header.stream_id)
                if answer is None or answer.done():
                    log.debug("ttrpc response on stream %d, which no call waits for", header.stream_id)
                    continue
                if payload is None:
                    answer.set_exception(
                        RemoteError(
                            grpc.StatusCode.RESOURCE_EXHAUSTED, f"the response of {header.length} bytes is too long"
                        )
                    )
                    continue
                response = ttrpc_pb2.Response()
                try:
                    response.ParseFromString(payload)
                except DecodeError as exc:
                    answer.set_exception(
                        ProtocolError(f"the response on stream {header.stream_id} doesn't parse: {exc}")
                    )
                    continue
                answer.set_result(response)
        except ConnectionLost as exc:
            self._end(exc)
        except BaseException as exc:
            self._end(exc if isinstance(exc, Exception) else ConnectionLost("the client stopped"))
            raise

    def _end(self, cause: Exception) -> None:
        self._ended = cause
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(ConnectionLost(f"the connection ended before the answer: {cause}"))
