"""HPACK, only as far as the CRI shim needs it.

The shim forwards kubelet's header blocks to the runtime untouched, so the runtime's HPACK decoder
stays in step with kubelet's encoder. The shim still has to know each new call's ``:path``, which
means following kubelet's dynamic table exactly (RFC 7541): every indexed insertion, eviction and
size update. :class:`PathDecoder` does just that and keeps no other header. It is several times
faster than a general decoder on the blocks gRPC clients send once warm (all indexed), and a call
pays for it on every request.

The shim's own answers (a refused CreateContainer) are encoded by :func:`trailers_only_block`
with static-table references and literals that are never indexed, so they leave kubelet's view of
the runtime's dynamic table unchanged.
"""

from __future__ import annotations

from collections import deque
from urllib.parse import quote

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = HeaderTable.STATIC_TABLE
ENTRY_OVERHEAD = 32
#: an encoder may ask for any size up to what the runtime allows; this only bounds a hostile client
MAX_TABLE_SIZE = 1 << 20
#: distinct Huffman-coded strings remembered; gRPC clients repeat the same few values
HUFFMAN_MEMO_LIMIT = 4096
PATH = b":path"


class HeaderBlockError(ValueError):
    """A header block that can't be decoded: the connection can't be followed any further."""


def _integer(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer whose prefix occupies the low ``prefix_bits`` of ``block[pos]``."""
    mask = (1 << prefix_bits) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block) or shift > 28:
            raise HeaderBlockError("truncated or oversized integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


class PathDecoder:
    """Follows one HPACK encoder (kubelet's side of a connection) and reports each block's ``:path``."""

    def __init__(self) -> None:
        self._table: deque[tuple[bytes, bytes]] = deque()  # newest first
        self._size = 0
        self._max_size = 4096
        self._huffman: dict[bytes, bytes] = {}

    @property
    def table_size(self) -> int:
        return self._size

    def path(self, block: bytes) -> bytes | None:
        """Decode ``block`` (updating the dynamic table) and return its ``:path``, if any."""
        found = None
        pos, end = 0, len(block)
        try:
            while pos < end:
                first = block[pos]
                if first & 0x80:  # indexed field
                    index, pos = _integer(block, pos, 7)
                    name, value = self._entry(index)
                elif first & 0x40:  # literal, added to the table
                    name, value, pos = self._literal(block, pos, 6)
                    self._insert(name, value)
                elif first & 0x20:  # dynamic table size update
                    size, pos = _integer(block, pos, 5)
                    if size > MAX_TABLE_SIZE:
                        raise HeaderBlockError(f"table size update to {size} bytes")
                    self._max_size = size
                    self._evict(0)
                    continue
                else:  # literal without indexing, or never indexed
                    name, value, pos = self._literal(block, pos, 4)
                if name == PATH:
                    found = value
        except IndexError:
            raise HeaderBlockError("truncated header block") from None
        return found

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        dynamic = index - len(STATIC_TABLE) - 1
        if 0 <= dynamic < len(self._table):
            return self._table[dynamic]
        raise HeaderBlockError(f"header table index {index} does not exist")

    def _literal(self, block: bytes, pos: int, prefix_bits: int) -> tuple[bytes, bytes, int]:
        index, pos = _integer(block, pos, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = self._string(block, pos)
        value, pos = self._string(block, pos)
        return name, value, pos

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        huffman = block[pos] & 0x80
        length, pos = _integer(block, pos, 7)
        end = pos + length
        if end > len(block):
            raise HeaderBlockError("truncated string literal")
        raw = block[pos:end]
        if not huffman:
            return raw, end
        text = self._huffman.get(raw)
        if text is None:
            try:
                text = decode_huffman(raw)
            except Exception as exc:  # the library raises its own error types
                raise HeaderBlockError(f"bad Huffman string: {exc}") from None
            if len(self._huffman) >= HUFFMAN_MEMO_LIMIT:
                self._huffman.clear()
            self._huffman[raw] = text
        return text, end

    def _insert(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + ENTRY_OVERHEAD
        if size > self._max_size:  # RFC 7541 4.4: an entry larger than the table empties it
            self._table.clear()
            self._size = 0
            return
        self._evict(size)
        self._table.appendleft((name, value))
        self._size += size

    def _evict(self, room: int) -> None:
        while self._table and self._size + room > self._max_size:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + ENTRY_OVERHEAD


def _literal_never_indexed(name: bytes, value: bytes) -> bytes:
    return b"\x10" + _string(name) + _string(value)


def _string(raw: bytes) -> bytes:
    return _prefixed(len(raw), 7, 0) + raw


def _prefixed(value: int, prefix_bits: int, flags: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([flags | value])
    out = bytearray([flags | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_STATUS_200 = b"\x88"  # static entry 8, ":status: 200"
_CONTENT_TYPE = 31  # static entry name "content-type"


def trailers_only_block(code: int, message: str) -> bytes:
    """A gRPC "trailers-only" response: HTTP 200, the status code and its percent-encoded message."""
    content_type = _prefixed(_CONTENT_TYPE, 4, 0x10) + _string(b"application/grpc")
    return (
        _STATUS_200
        + content_type
        + _literal_never_indexed(b"grpc-status", str(code).encode())
        + _literal_never_indexed(b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode())
    )
