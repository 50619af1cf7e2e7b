"""ttRPC framing, NRI's multiplexer, and ttRPC's server and client, over real unix sockets."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from gpushare.pb import nri_pb2, ttrpc_pb2
from gpushare.ttrpc.client import Client
from gpushare.ttrpc.errors import ConnectionLost, OversizedMessage, ProtocolError, RemoteError, Status
from gpushare.ttrpc.framing import (
    HEADER_LENGTH,
    MAX_MESSAGE_LENGTH,
    MessageType,
    StreamChannel,
    decode_header,
    encode,
    read_message,
)
from gpushare.ttrpc.mux import MAX_FRAME_PAYLOAD, SEND_CHUNK, Mux
from gpushare.ttrpc.server import Method, Server

SERVICE = "test.v1.Echo"


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), 10))


async def stream_pair() -> tuple[
    tuple[asyncio.StreamReader, asyncio.StreamWriter], tuple[asyncio.StreamReader, asyncio.StreamWriter]
]:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await asyncio.open_unix_connection(sock=left), await asyncio.open_unix_connection(sock=right)


def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


# --- framing ----------------------------------------------------------------------------------------------


def test_a_message_is_a_ten_byte_big_endian_header_and_its_payload() -> None:
    message = encode(0x01020305, MessageType.REQUEST, b"abc", flags=0x04)
    assert message == bytes.fromhex("00000003010203050104") + b"abc"
    header = decode_header(message[:HEADER_LENGTH])
    assert (header.length, header.stream_id, header.type, header.flags) == (3, 0x01020305, MessageType.REQUEST, 4)


def test_a_payload_over_four_mebibytes_is_refused_before_sending() -> None:
    with pytest.raises(OversizedMessage, match=f"{MAX_MESSAGE_LENGTH + 1} bytes exceeds the maximum of 4194304"):
        encode(1, MessageType.RESPONSE, bytes(MAX_MESSAGE_LENGTH + 1))


def test_an_unknown_message_type_is_a_protocol_error_naming_it() -> None:
    with pytest.raises(ProtocolError, match="message type 0x07 on stream 9 is not request, response or data"):
        decode_header(struct.pack(">IIBB", 0, 9, 7, 0))


def test_an_oversized_message_is_read_past_and_the_next_one_still_read() -> None:
    async def scenario() -> None:
        oversized = struct.pack(">IIBB", MAX_MESSAGE_LENGTH + 5, 3, MessageType.REQUEST, 0) + bytes(
            MAX_MESSAGE_LENGTH + 5
        )
        reader = reader_of(oversized + encode(5, MessageType.REQUEST, b"next"))
        header, payload = await read_message(reader)
        assert (header.stream_id, header.length, payload) == (3, MAX_MESSAGE_LENGTH + 5, None)
        header, payload = await read_message(reader)
        assert (header.stream_id, payload) == (5, b"next")

    run(scenario)


def test_a_stream_ending_inside_a_message_is_a_lost_connection() -> None:
    async def scenario() -> None:
        with pytest.raises(ConnectionLost, match="ended 4 bytes into a 10-byte read"):
            await read_message(reader_of(encode(1, MessageType.REQUEST, b"xyz")[:4]))
        with pytest.raises(ConnectionLost, match="ended 2 bytes into a 5-byte read"):
            await read_message(reader_of(encode(1, MessageType.REQUEST, b"hello")[:12]))
        with pytest.raises(ConnectionLost, match="closed the connection"):
            await read_message(reader_of(b""))

    run(scenario)


# --- the multiplexer --------------------------------------------------------------------------------------


def frame(conn_id: int, payload: bytes) -> bytes:
    return struct.pack(">II", conn_id, len(payload)) + payload


def test_frames_are_joined_back_into_each_connections_stream() -> None:
    async def scenario() -> None:
        (reader, writer), (_, peer) = await stream_pair()
        mux = Mux(reader, writer)
        one, two = mux.open(1), mux.open(2)
        assert mux.open(1) is one
        # one message cut across frames, interleaved with another connection's, and a frame nobody opened
        message = encode(1, MessageType.REQUEST, b"payload for the plugin")
        # and one larger than what we send per frame, as Go writes a big message past its buffer
        large = encode(3, MessageType.REQUEST, bytes(3 * SEND_CHUNK))
        peer.write(frame(1, message[:7]) + frame(2, b"runtime") + frame(7, b"dropped") + frame(1, message[7:]))
        peer.write(frame(1, large))
        peer.close()
        await mux.run()
        header, payload = await read_message(one.reader)
        assert (header.stream_id, payload) == (1, b"payload for the plugin")
        header, payload = await read_message(one.reader)
        assert (header.stream_id, payload) == (3, bytes(3 * SEND_CHUNK))
        assert await two.reader.read() == b"runtime"
        assert one.reader.at_eof()

    run(scenario)


def test_what_is_sent_is_cut_into_frames_go_reads_whole() -> None:
    async def scenario() -> None:
        (reader, writer), (peer_reader, _) = await stream_pair()
        mux = Mux(reader, writer)
        data = bytes(range(256)) * 40  # 10240 bytes
        await mux.open(2).send(data)
        sizes, received = [], b""
        while len(received) < len(data):
            conn_id, length = struct.unpack(">II", await peer_reader.readexactly(8))
            assert conn_id == 2
            sizes.append(length)
            received += await peer_reader.readexactly(length)
        assert received == data and sizes == [SEND_CHUNK, SEND_CHUNK, 10240 - 2 * SEND_CHUNK]

    run(scenario)


@pytest.mark.parametrize(
    ("raw", "error", "text"),
    [
        (
            struct.pack(">II", 1, MAX_FRAME_PAYLOAD + 1),
            OversizedMessage,
            "multiplexer frame for connection 1 of 4194315",
        ),
        (frame(0, b"x"), ProtocolError, "reserved connection 0"),
        (struct.pack(">II", 1, 10) + b"abc", ConnectionLost, "ended 3 bytes into a 10-byte read"),
        (b"\x00\x00\x00", ConnectionLost, "inside a multiplexer frame header"),
    ],
)
def test_a_malformed_frame_ends_every_connection_with_the_reason(raw: bytes, error: type[Exception], text: str) -> None:
    async def scenario() -> None:
        (reader, writer), (_, peer) = await stream_pair()
        mux = Mux(reader, writer)
        channel = mux.open(1)
        peer.write(raw)
        peer.close()
        with pytest.raises(error, match=text):
            await mux.run()
        with pytest.raises(error, match=text):
            await channel.reader.read(1)
        with pytest.raises(ConnectionLost, match="is closed"):
            await channel.send(b"late")

    run(scenario)


def test_connection_zero_is_reserved() -> None:
    async def scenario() -> None:
        (reader, writer), _ = await stream_pair()
        with pytest.raises(ValueError, match="reserved"):
            Mux(reader, writer).open(0)

    run(scenario)


# --- server and client ------------------------------------------------------------------------------------


class Echo:
    """A service whose calls wait on each other, to show answers travel by stream id."""

    def __init__(self) -> None:
        self.second_arrived = asyncio.Event()
        self.hanging = asyncio.Event()

    async def first(self, request: nri_pb2.KeyValue) -> nri_pb2.KeyValue:
        await self.second_arrived.wait()
        return nri_pb2.KeyValue(key=request.key, value="first")

    async def second(self, request: nri_pb2.KeyValue) -> nri_pb2.KeyValue:
        self.second_arrived.set()
        return nri_pb2.KeyValue(key=request.key, value="second")

    async def refuse(self, request: nri_pb2.KeyValue) -> nri_pb2.KeyValue:
        raise Status(grpc.StatusCode.PERMISSION_DENIED, f"no {request.key}")

    async def crash(self, request: nri_pb2.KeyValue) -> nri_pb2.KeyValue:
        raise ValueError(f"bad {request.key}")

    async def hang(self, request: nri_pb2.KeyValue) -> nri_pb2.KeyValue:
        self.hanging.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def server(self) -> Server:
        server = Server()
        server.register(
            SERVICE,
            {
                name: Method(nri_pb2.KeyValue, getattr(self, name))
                for name in ("first", "second", "refuse", "crash", "hang")
            },
        )
        return server


async def connected(echo: Echo) -> tuple[Client, list[asyncio.Task[None]], StreamChannel]:
    (reader, writer), (peer_reader, peer_writer) = await stream_pair()
    served = StreamChannel(peer_reader, peer_writer)
    client = Client(StreamChannel(reader, writer))
    tasks = [asyncio.create_task(echo.server().serve(served)), asyncio.create_task(client.run())]
    return client, tasks, served


def call(client: Client, method: str, key: str = "k", timeout: float | None = None) -> Awaitable[nri_pb2.KeyValue]:
    return client.call(SERVICE, method, nri_pb2.KeyValue(key=key), nri_pb2.KeyValue, timeout=timeout)


def test_concurrent_calls_get_their_own_answers_whatever_the_order() -> None:
    async def scenario() -> None:
        client, _, _ = await connected(Echo())
        first = asyncio.create_task(call(client, "first", "a"))
        second = asyncio.create_task(call(client, "second", "b"))
        assert (await first, await second) == (
            nri_pb2.KeyValue(key="a", value="first"),
            nri_pb2.KeyValue(key="b", value="second"),
        )

    run(scenario)


@pytest.mark.parametrize(
    ("service", "method", "code", "text"),
    [
        (SERVICE, "refuse", grpc.StatusCode.PERMISSION_DENIED, "no k"),
        (SERVICE, "crash", grpc.StatusCode.UNKNOWN, "bad k"),
        (SERVICE, "missing", grpc.StatusCode.UNIMPLEMENTED, "method missing"),
        ("test.v1.Other", "first", grpc.StatusCode.UNIMPLEMENTED, "service test.v1.Other"),
    ],
)
def test_a_failed_call_raises_the_servers_status(service: str, method: str, code: grpc.StatusCode, text: str) -> None:
    async def scenario() -> None:
        client, _, _ = await connected(Echo())
        with pytest.raises(RemoteError) as raised:
            await client.call(service, method, nri_pb2.KeyValue(key="k"), nri_pb2.KeyValue)
        assert (raised.value.code, raised.value.message) == (code, text)

    run(scenario)


async def raw_peer(echo: Echo) -> tuple[asyncio.StreamWriter, Callable[[], Awaitable[tuple[int, ttrpc_pb2.Response]]]]:
    """A client side written by hand: the writer, and a reader of (stream id, response)."""
    (reader, writer), (peer_reader, peer_writer) = await stream_pair()
    serving = asyncio.create_task(echo.server().serve(StreamChannel(peer_reader, peer_writer)))

    async def response() -> tuple[int, ttrpc_pb2.Response]:
        assert not serving.done(), "the server stopped"
        header, payload = await read_message(reader)
        assert header.type == MessageType.RESPONSE and payload is not None
        return header.stream_id, ttrpc_pb2.Response.FromString(payload)

    return writer, response


def request(method: str, timeout_nano: int = 0) -> bytes:
    return ttrpc_pb2.Request(service=SERVICE, method=method, payload=b"", timeout_nano=timeout_nano).SerializeToString()


def test_the_callers_deadline_bounds_the_handler_and_the_wait() -> None:
    async def scenario() -> None:
        writer, response = await raw_peer(Echo())
        writer.write(encode(1, MessageType.REQUEST, request("hang", timeout_nano=10_000_000)))
        stream_id, answer = await response()
        assert (stream_id, answer.status.code) == (1, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
        assert answer.status.message == f"{SERVICE}/hang ran past the caller's deadline"
        client, _, _ = await connected(Echo())
        with pytest.raises(TimeoutError):
            await call(client, "hang", timeout=0.01)

    run(scenario)


def test_requests_on_bad_streams_are_answered_with_invalid_argument() -> None:
    async def scenario() -> None:
        writer, response = await raw_peer(Echo())

        async def answer(stream_id: int, kind: MessageType = MessageType.REQUEST) -> ttrpc_pb2.Response:
            writer.write(encode(stream_id, kind, request("second")))
            answered, reply = await response()
            assert answered == stream_id
            return reply

        assert (await answer(4)).status.message == "stream ids of client requests must be odd"
        assert (await answer(5)).status.code == 0
        assert (await answer(3)).status.message == "stream ids must increase and can't be reused"
        assert (await answer(7, MessageType.DATA)).status.message == "data messages aren't served"
        writer.write(struct.pack(">IIBB", MAX_MESSAGE_LENGTH + 1, 9, 1, 0) + bytes(MAX_MESSAGE_LENGTH + 1))
        stream_id, reply = await response()
        assert (stream_id, reply.status.code) == (9, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
        assert (await answer(11)).status.code == 0

    run(scenario)


def test_calls_waiting_when_the_connection_ends_fail_and_so_do_later_ones() -> None:
    async def scenario() -> None:
        echo = Echo()
        client, tasks, served = await connected(echo)
        waiting = asyncio.create_task(call(client, "hang"))
        await echo.hanging.wait()
        served.close()
        await asyncio.gather(*tasks)
        with pytest.raises(ConnectionLost, match="ended before the answer"):
            await waiting
        with pytest.raises(ConnectionLost, match="has ended"):
            await call(client, "second")

    run(scenario)


def test_both_services_share_one_socket_through_the_multiplexer() -> None:
    """As NRI runs them: each side serves on one connection id and calls on the other."""

    async def scenario() -> None:
        (reader, writer), (peer_reader, peer_writer) = await stream_pair()
        plugin, runtime = Mux(reader, writer), Mux(peer_reader, peer_writer)
        plugin_echo, runtime_echo = Echo(), Echo()
        tasks = [
            asyncio.create_task(plugin.run()),
            asyncio.create_task(runtime.run()),
            asyncio.create_task(plugin_echo.server().serve(plugin.open(1))),
            asyncio.create_task(runtime_echo.server().serve(runtime.open(2))),
        ]
        to_plugin, to_runtime = Client(runtime.open(1)), Client(plugin.open(2))
        tasks += [asyncio.create_task(to_plugin.run()), asyncio.create_task(to_runtime.run())]
        big = "x" * (3 * SEND_CHUNK)
        results = await asyncio.gather(
            call(to_plugin, "first", "p1"),
            call(to_runtime, "first", "r1"),
            call(to_runtime, "second", big),
            call(to_plugin, "second", "p2"),
        )
        assert [(r.key[:2], r.value) for r in results] == [
            ("p1", "first"),
            ("r1", "first"),
            ("xx", "second"),
            ("p2", "second"),
        ]
        assert results[2].key == big
        runtime.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(ConnectionLost):
            await call(to_runtime, "second")

    run(scenario)
