"""A ttRPC message on the wire, following github.com/containerd/ttrpc's channel.go (v1.2.7).

Each message is a 10-byte big-endian header (payload length: 4 bytes; stream id: 4; type: 1; flags: 1)
and then the payload. Payloads are bounded at 4 MiB. A request or response payload is a
``ttrpc.Request`` / ``ttrpc.Response`` protobuf; data messages (streaming) aren't used by NRI.

Messages travel over a :class:`Channel`: a plain stream socket, or one connection of NRI's multiplexer
(:mod:`gpushare.ttrpc.mux`). A message is handed to :meth:`Channel.send` whole, so concurrent senders
never interleave their bytes.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from dataclasses import dataclass
from typing import Protocol

from gpushare.ttrpc.errors import ConnectionLost, OversizedMessage, ProtocolError

_HEADER = struct.Struct(">IIBB")
HEADER_LENGTH = _HEADER.size
#: the largest payload ttRPC sends or accepts (channel.go's messageLengthMax)
MAX_MESSAGE_LENGTH = 4 << 20


class MessageType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


@dataclass(frozen=True, slots=True)
class Header:
    length: int
    stream_id: int
    type: MessageType
    flags: int


class Channel(Protocol):
    """A byte stream to the peer: what ttRPC's client and server run over."""

    reader: asyncio.StreamReader

    async def send(self, data: bytes) -> None:
        """Write ``data`` as one piece: nothing else is written in between."""
        ...


class StreamChannel:
    """A :class:`Channel` over a plain asyncio stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self._writer = writer

    async def send(self, data: bytes) -> None:
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise ConnectionLost(f"writing to the peer failed: {exc}") from exc

    def close(self) -> None:
        self._writer.close()


def encode(stream_id: int, kind: MessageType, payload: bytes, flags: int = 0) -> bytes:
    """One message, header and payload; refuses a payload over :data:`MAX_MESSAGE_LENGTH`."""
    if len(payload) > MAX_MESSAGE_LENGTH:
        raise OversizedMessage("ttrpc message payload", len(payload), MAX_MESSAGE_LENGTH)
    return _HEADER.pack(len(payload), stream_id, kind, flags) + payload


def decode_header(raw: bytes) -> Header:
    """The header in ``raw`` (exactly :data:`HEADER_LENGTH` bytes); an unknown type is a protocol error."""
    length, stream_id, kind, flags = _HEADER.unpack(raw)
    try:
        message_type = MessageType(kind)
    except ValueError:
        raise ProtocolError(
            f"message type 0x{kind:02x} on stream {stream_id} is not request, response or data"
        ) from None
    return Header(length, stream_id, message_type, flags)


async def read_exactly(reader: asyncio.StreamReader, count: int) -> bytes:
    """``count`` bytes, or :class:`ConnectionLost` when the stream ends first."""
    try:
        return await reader.readexactly(count)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionLost(f"the connection ended {len(exc.partial)} bytes into a {count}-byte read") from None
        raise ConnectionLost("the peer closed the connection") from None


async def read_message(reader: asyncio.StreamReader) -> tuple[Header, bytes | None]:
    """The next message. An oversized one is read past and returned with ``None`` for its payload, so
    that the caller can answer its stream with an error and go on, as ttRPC does."""
    header = decode_header(await read_exactly(reader, HEADER_LENGTH))
    if header.length > MAX_MESSAGE_LENGTH:
        remaining = header.length
        while remaining:
            remaining -= len(await read_exactly(reader, min(remaining, 1 << 16)))
        return header, None
    return header, await read_exactly(reader, header.length) if header.length else b""
