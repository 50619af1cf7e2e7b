"""NRI's connection multiplexer, following github.com/containerd/nri v0.11.0's pkg/net/multiplex (mux.go
and ttrpc.go): several byte streams over one socket, so that the runtime and the plugin each serve and
call over the single connection the plugin opened.

Every frame on the socket is an 8-byte big-endian header (connection id: 4 bytes; payload length: 4)
and then that many bytes of the connection's stream. Frames don't follow message boundaries; the
receiver joins a connection's payloads back into its stream. Connection 0 is reserved, 1 carries the
``Plugin`` service (the runtime calls, the plugin serves) and 2 the ``Runtime`` service (the plugin
calls). A frame's payload is at most a ttRPC header plus the largest ttRPC message; frames for a
connection nobody opened are dropped, as upstream does.

What we send is cut into frames of at most :data:`SEND_CHUNK` bytes. Go's side reads each connection
through a 4 KiB ``bufio.Reader`` and its connection's ``Read`` fails outright when a frame doesn't fit
the buffer it is given, so frames no larger than that buffer are the ones it always accepts.
"""

from __future__ import annotations

import asyncio
import logging
import struct

from gpushare.ttrpc.errors import ConnectionLost, OversizedMessage, ProtocolError
from gpushare.ttrpc.framing import HEADER_LENGTH, MAX_MESSAGE_LENGTH, read_exactly

log = logging.getLogger(__name__)

_FRAME = struct.Struct(">II")
FRAME_HEADER_LENGTH = _FRAME.size
RESERVED_CONN = 0
#: the runtime calls the plugin's Plugin service on this connection
PLUGIN_SERVICE_CONN = 1
#: the plugin calls the runtime's Runtime service on this connection
RUNTIME_SERVICE_CONN = 2
#: the largest frame payload accepted (upstream's maxPayloadSize)
MAX_FRAME_PAYLOAD = HEADER_LENGTH + MAX_MESSAGE_LENGTH
#: the largest frame payload sent: the size of Go's default bufio.Reader
SEND_CHUNK = 4096


class MuxChannel:
    """One multiplexed connection, a :class:`gpushare.ttrpc.framing.Channel`."""

    def __init__(self, mux: Mux, conn_id: int) -> None:
        self.conn_id = conn_id
        self.reader = asyncio.StreamReader(limit=MAX_FRAME_PAYLOAD)
        self._mux = mux

    async def send(self, data: bytes) -> None:
        await self._mux.send(self.conn_id, data)


class Mux:
    """The multiplexer over one connected socket. :meth:`run` reads the socket until it ends; every
    opened channel's reader then ends too (with the error, when it broke)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._channels: dict[int, MuxChannel] = {}
        self._closed = False

    def open(self, conn_id: int) -> MuxChannel:
        """The channel for ``conn_id`` (the same one on each call)."""
        if conn_id == RESERVED_CONN:
            raise ValueError(f"connection id {RESERVED_CONN} is reserved")
        if conn_id not in self._channels:
            self._channels[conn_id] = MuxChannel(self, conn_id)
        return self._channels[conn_id]

    async def send(self, conn_id: int, data: bytes) -> None:
        """Write ``data`` to connection ``conn_id``. All its frames are queued before the first await,
        so one call's bytes never interleave with another's."""
        if self._closed or self._writer.is_closing():
            raise ConnectionLost("the multiplexed connection is closed")
        for start in range(0, max(len(data), 1), SEND_CHUNK):
            chunk = data[start : start + SEND_CHUNK]
            self._writer.write(_FRAME.pack(conn_id, len(chunk)) + chunk)
        try:
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise ConnectionLost(f"writing to the multiplexed connection failed: {exc}") from exc

    async def run(self) -> None:
        """Deliver frames until the socket ends. Returns on a clean end of stream; raises
        :class:`ProtocolError` for a malformed frame (after ending every channel with it)."""
        failure: Exception | None = None
        try:
            while True:
                try:
                    raw = await self._reader.readexactly(FRAME_HEADER_LENGTH)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        raise ConnectionLost("the connection ended inside a multiplexer frame header") from None
                    return
                conn_id, length = _FRAME.unpack(raw)
                if length > MAX_FRAME_PAYLOAD:
                    raise OversizedMessage(f"multiplexer frame for connection {conn_id}", length, MAX_FRAME_PAYLOAD)
                if conn_id == RESERVED_CONN:
                    raise ProtocolError(f"multiplexer frame of {length} bytes for the reserved connection 0")
                payload = await read_exactly(self._reader, length)
                channel = self._channels.get(conn_id)
                if channel is None:
                    log.debug("dropping %d bytes for unopened multiplexed connection %d", length, conn_id)
                else:
                    channel.reader.feed_data(payload)
        except (ConnectionError, ConnectionLost, ProtocolError) as exc:
            failure = exc
            raise
        finally:
            self._end(failure)

    def _end(self, failure: Exception | None) -> None:
        self._closed = True
        for channel in self._channels.values():
            if failure is None:
                channel.reader.feed_eof()
            else:
                channel.reader.set_exception(
                    failure if isinstance(failure, ConnectionLost | ProtocolError) else ConnectionLost(str(failure))
                )
        self._writer.close()

    def close(self) -> None:
        """Close the socket; :meth:`run` then ends."""
        self._closed = True
        self._writer.close()
