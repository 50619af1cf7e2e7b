"""HTTP/2 frames (RFC 9113) and gRPC message framing: the few the CRI shim reads or writes itself."""

from __future__ import annotations

import struct
from collections.abc import Iterator

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = 9

DATA = 0x0
HEADERS = 0x1
RST_STREAM = 0x3
SETTINGS = 0x4
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY = 0x20

SETTINGS_INITIAL_WINDOW_SIZE = 0x4
DEFAULT_WINDOW = 65535
#: every peer must accept frames this large, whatever it advertises
MIN_MAX_FRAME_SIZE = 16384
MAX_WINDOW = (1 << 31) - 1

ERROR_NO_ERROR = 0x0
#: RFC 9113 section 8.7: the stream was not processed, so the client may retry it (gRPC does, transparently)
ERROR_REFUSED_STREAM = 0x7
ERROR_CANCEL = 0x8

GRPC_PREFIX = 5


class FrameError(ValueError):
    """A frame that breaks HTTP/2's rules: the connection can't be followed any further."""


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


def rst_stream(stream: int, error_code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, error_code.to_bytes(4, "big"))


def goaway(last_stream: int) -> bytes:
    """A GOAWAY without error: the sender processes no stream above ``last_stream``, so the client opens
    its next calls on a new connection and may retry any it opened above it."""
    return frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + ERROR_NO_ERROR.to_bytes(4, "big"))


def headers_frame(stream: int, block: bytes, end_stream: bool) -> bytes:
    """One HEADERS frame with the whole block (the shim's own blocks are a few dozen bytes)."""
    return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream, block)


def unpadded(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (and, for HEADERS, without its priority fields)."""
    if flags & PADDED:
        if not payload or payload[0] >= len(payload):
            raise FrameError("padding longer than the frame")
        payload = payload[1 : len(payload) - payload[0]]
    return payload


def header_fragment(flags: int, payload: bytes) -> bytes:
    payload = unpadded(flags, payload)
    return payload[5:] if flags & PRIORITY else payload


def settings_pairs(payload: bytes) -> Iterator[tuple[int, int]]:
    if len(payload) % 6:
        raise FrameError("SETTINGS payload is not a multiple of 6 bytes")
    for at in range(0, len(payload), 6):
        yield struct.unpack_from(">HI", payload, at)


def increment_of(payload: bytes) -> int:
    if len(payload) != 4:
        raise FrameError("WINDOW_UPDATE payload is not 4 bytes")
    return int.from_bytes(payload, "big") & MAX_WINDOW


def grpc_message(message: bytes) -> bytes:
    """An uncompressed gRPC length-prefixed message."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


class GrpcFramingError(ValueError):
    """A request body that isn't exactly one uncompressed gRPC message."""


def single_grpc_message(body: bytes) -> bytes:
    if len(body) < GRPC_PREFIX:
        raise GrpcFramingError("the request carries no gRPC message")
    if body[0] != 0:
        raise GrpcFramingError("the request message is compressed; the shim only reads uncompressed requests")
    length = int.from_bytes(body[1:GRPC_PREFIX], "big")
    if len(body) != GRPC_PREFIX + length:
        raise GrpcFramingError(f"expected one message of {length} bytes, the request body has {len(body)}")
    return body[GRPC_PREFIX:]


def frame_at(buf: bytes, pos: int) -> tuple[int, int, int, int] | None:
    """The frame starting at ``pos``: where it ends, its type, flags and stream; None until it has all arrived."""
    if len(buf) - pos < FRAME_HEADER:
        return None
    end = pos + FRAME_HEADER + int.from_bytes(buf[pos : pos + 3], "big")
    if end > len(buf):
        return None
    return end, buf[pos + 3], buf[pos + 4], int.from_bytes(buf[pos + 5 : pos + 9], "big") & MAX_WINDOW


def header_block(buf: bytes, pos: int) -> tuple[bytes, int] | None:
    """The header block whose HEADERS frame starts at ``pos``: its fragments joined, and where its last
    frame ends; None while its CONTINUATION frames haven't all arrived."""
    fragments = []
    first = True
    while (found := frame_at(buf, pos)) is not None:
        end, kind, flags, _ = found
        if kind != (HEADERS if first else CONTINUATION):
            raise FrameError("a header block is interrupted by another frame")
        payload = buf[pos + FRAME_HEADER : end]
        fragments.append(header_fragment(flags, payload) if first else payload)
        if flags & END_HEADERS:
            return b"".join(fragments), end
        first, pos = False, end
    return None
