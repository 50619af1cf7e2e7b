"""The CRI shim's HTTP/2 pieces, without sockets: following kubelet's HPACK table, the frames it reads
and writes, and the flow-control ledger for held calls. The ``hpack`` library is the reference
encoder and decoder."""

from __future__ import annotations

import random

import pytest
from gpushare.crishim.flow import Windows
from gpushare.crishim.frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PADDED,
    PRIORITY,
    SETTINGS_INITIAL_WINDOW_SIZE,
    FrameError,
    GrpcFramingError,
    frame,
    grpc_message,
    header_block,
    single_grpc_message,
    unpadded,
)
from gpushare.crishim.headers import HeaderBlockError, PathDecoder, trailers_only_block
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple

METHODS = [f"/runtime.v1.RuntimeService/{m}" for m in ("Version", "ListContainers", "CreateContainer", "ExecSync")]


def request_headers(path: str, rng: random.Random) -> list[tuple[str, str]]:
    """What a gRPC client sends: the same few headers, a deadline that changes every call."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", f"{rng.randrange(1, 99_999_999)}u"),
        ("user-agent", "grpc-go/1.70.0"),
        ("x-request-id", f"{rng.random():.12f}" * rng.randrange(1, 4)),
    ]


def table_bytes(decoder: Decoder) -> int:
    return sum(32 + len(name) + len(value) for name, value in decoder.header_table.dynamic_entries)


@pytest.mark.parametrize("table_size", [4096, 256, 0])
@pytest.mark.parametrize("huffman", [True, False])
def test_path_decoder_follows_the_encoders_table_call_after_call(table_size: int, huffman: bool) -> None:
    rng = random.Random(table_size)
    encoder = Encoder()
    encoder.header_table_size = table_size  # emits a size update in the next block; small tables evict
    follower, reference = PathDecoder(), Decoder()
    for _ in range(500):
        path = rng.choice(METHODS)
        block = encoder.encode(request_headers(path, rng), huffman=huffman)
        assert follower.path(block) == path.encode()
        assert dict(reference.decode(block))[":path"] == path
        assert follower.table_size == table_bytes(reference)


def test_path_decoder_reads_literals_that_stay_out_of_the_table() -> None:
    encoder = Encoder()
    block = encoder.encode([NeverIndexedHeaderTuple(":path", "/x.Y/Z"), (":method", "POST")])
    follower = PathDecoder()
    assert follower.path(block) == b"/x.Y/Z"
    assert follower.path(encoder.encode([(":method", "POST")])) is None


def test_path_decoder_empties_the_table_for_an_entry_larger_than_the_table() -> None:
    encoder = Encoder()
    encoder.header_table_size = 100
    follower = PathDecoder()
    follower.path(encoder.encode([("x-small", "1")]))
    assert follower.table_size > 0
    assert follower.path(encoder.encode([(":path", "/a/" + "b" * 200)])) == b"/a/" + b"b" * 200
    assert follower.table_size == 0


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        (b"\xff\x80", "integer"),  # an index whose continuation bytes are missing
        (b"\xc5", "table index 69"),  # a dynamic entry nobody inserted
        (b"\x40\x05:pa", "Truncated"),  # a literal name cut short
        (b"\x3f\xe1\xff\xff\x7f", "table size"),  # a size far beyond any peer's limit
    ],
)
def test_path_decoder_rejects_blocks_it_cant_follow(block: bytes, problem: str) -> None:
    with pytest.raises(HeaderBlockError, match=problem):
        PathDecoder().path(block)


def test_trailers_only_answer_is_a_grpc_status_that_leaves_the_table_alone() -> None:
    decoder = Decoder()
    message = "pod default/a container b: card 1 (GPU-x) is not on this node; 100% sure\n"
    headers = decoder.decode(trailers_only_block(9, message))
    assert headers == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", "9"),
        ("grpc-message", "pod default/a container b: card 1 (GPU-x) is not on this node; 100%25 sure%0A"),
    ]
    assert not decoder.header_table.dynamic_entries  # kubelet's view of the runtime's table is unchanged


def test_header_block_joins_continuations_and_strips_padding_and_priority() -> None:
    fragment = Encoder().encode(request_headers(METHODS[0], random.Random(1)))
    first, second = fragment[:10], fragment[10:]
    padded_priority = bytes([3]) + b"\x00\x00\x00\x00\x10" + first + b"\x00" * 3
    buf = frame(HEADERS, PADDED | PRIORITY, 1, padded_priority) + frame(CONTINUATION, END_HEADERS, 1, second)
    assert header_block(buf, 0) == (fragment, len(buf))
    assert header_block(buf[:-1], 0) is None  # the CONTINUATION hasn't fully arrived


def test_header_block_interrupted_by_another_frame_is_an_error() -> None:
    buf = frame(HEADERS, 0, 1, b"\x82") + frame(DATA, 0, 1, b"x")
    with pytest.raises(FrameError, match="interrupted"):
        header_block(buf, 0)


def test_padding_longer_than_the_frame_is_an_error() -> None:
    assert unpadded(PADDED, b"\x02abcXY") == b"abc"
    with pytest.raises(FrameError):
        unpadded(PADDED, b"\x09ab")


def test_a_request_body_must_be_one_uncompressed_message() -> None:
    assert single_grpc_message(grpc_message(b"hello")) == b"hello"
    with pytest.raises(GrpcFramingError, match="compressed"):
        single_grpc_message(b"\x01" + grpc_message(b"hello")[1:])
    with pytest.raises(GrpcFramingError, match="one message"):
        single_grpc_message(grpc_message(b"a") + grpc_message(b"b"))
    with pytest.raises(GrpcFramingError, match="no gRPC message"):
        single_grpc_message(b"")


# --- the flow-control ledger ---------------------------------------------------------------------------


def test_bytes_sent_for_a_held_call_are_kept_out_of_kubelets_window_updates() -> None:
    windows = Windows()
    windows.track(1)
    assert windows.try_take(1, 1000)  # a held request, already paid back to kubelet, goes out
    assert (windows.connection, windows.owed) == (65535 - 1000, 1000)
    assert windows.on_update(0, 600) == 0  # the runtime pays it back: kubelet doesn't get it twice
    assert windows.on_update(0, 600) == 200
    assert (windows.connection, windows.owed) == (65535 + 200, 0)
    assert windows.on_update(0, 50) == 50


def test_a_frame_that_would_overrun_the_runtime_waits_for_its_update() -> None:
    windows = Windows()
    assert windows.try_consume(65000)
    assert not windows.try_consume(1000)
    assert windows.connection == 535  # a refused frame takes nothing
    windows.on_update(0, 1000)
    assert windows.try_consume(1000)


def test_a_held_call_waits_for_its_stream_window_and_follows_settings_changes() -> None:
    windows = Windows()
    windows.track(3)
    windows.on_update(0, 1 << 20)
    assert not windows.try_take(3, 70_000)  # over the stream's initial 65,535
    windows.on_settings([(SETTINGS_INITIAL_WINDOW_SIZE, 100_000)])
    assert windows.stream(3) == 100_000
    assert windows.try_take(3, 70_000)
    windows.on_update(3, 5)
    assert windows.stream(3) == 30_005
    windows.track(5)
    assert windows.stream(5) == 100_000  # new streams start at the new initial window
    windows.forget(3)
    assert windows.on_update(3, 7) == 7 and windows.stream(3) == 0


def test_a_frame_is_length_type_flags_stream_then_payload() -> None:
    data = frame(DATA, END_STREAM, 1, b"abc")
    assert data[:9] == b"\x00\x00\x03\x00\x01\x00\x00\x00\x01" and data[9:] == b"abc"
