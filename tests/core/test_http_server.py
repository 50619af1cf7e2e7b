"""The HTTP server every component answers on (gpushare.tlshttp), as its peers see it: bodies up to the
limit are served, heads and bodies that trickle in are cut at the read timeout, idle connections at the
idle timeout, a flood of malformed requests is logged a line at a time, and stopping (or failing) leaves
nothing behind. Loopback only."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from support.waiting import wait_until

from gpushare import tlshttp
from gpushare.tlshttp import (
    DEFAULT_LIMITS,
    LOG_EVERY,
    MAX_JSON_DEPTH,
    BadJSON,
    HttpServer,
    Limits,
    Reply,
    Request,
    parse_json,
)


def echo(request: Request) -> Reply:
    return Reply(200, str(len(request.body)).encode(), "text/plain")


@contextlib.contextmanager
def serving(limits: Limits = DEFAULT_LIMITS) -> Iterator[HttpServer]:
    server = HttpServer("127.0.0.1", 0, echo, limits=limits)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def post(conn: http.client.HTTPConnection, body: bytes) -> bytes:
    conn.request("POST", "/echo", body, {"Content-Type": "application/octet-stream"})
    reply = conn.getresponse()
    assert reply.status == 200
    return reply.read()


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_a_request_without_a_body_is_answered() -> None:
    with serving() as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/healthz")
        reply = conn.getresponse()
        assert (reply.status, reply.read()) == (200, b"0")
        # nothing that tells a scanner which versions of Python and aiohttp to attack
        assert reply.getheader("Server") == "gpushare"
        conn.close()


def test_a_body_up_to_the_limit_is_served_and_one_over_it_refused() -> None:
    limits = Limits(max_body=3 << 20)
    with serving(limits) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        assert post(conn, b"x" * limits.max_body) == str(limits.max_body).encode()
        conn.close()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {limits.max_body + 1}\r\n\r\n".encode())
            assert sock.recv(100).split(b" ")[1] == b"413"


def test_a_head_that_trickles_in_is_cut_at_the_read_timeout() -> None:
    """A byte every 50 ms keeps the peer busy, never the server past read_timeout."""
    limits = Limits(read_timeout=0.5)
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"y" * 400
    stop = threading.Event()
    with serving(limits) as server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:

        def trickle() -> None:
            for byte in head:
                if stop.wait(0.05):
                    return
                with contextlib.suppress(OSError):
                    sock.send(bytes([byte]))

        thread = threading.Thread(target=trickle)
        thread.start()
        try:
            wait_until(lambda: server.open_connections == 0, timeout=3, what="the trickling head dropped")
            assert closed_by_server(sock)
        finally:
            stop.set()
            thread.join()


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() -> None:
    limits = Limits(idle_timeout=0.5)
    with serving(limits) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        assert post(conn, b"{}") == b"2"
        assert server.open_connections == 1
        wait_until(lambda: server.open_connections == 0, timeout=3, what="the idle connection closed")
        assert conn.sock is not None and closed_by_server(conn.sock)
        conn.close()


def test_a_flood_of_malformed_requests_is_answered_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO), serving() as server:
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
                assert sock.recv(100).split(b" ")[1] == b"400"
    told = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(told) == 1 and told[0].name == "gpushare.tlshttp", [r.getMessage() for r in told]
    message = told[0].getMessage()
    assert "400 from" in message and "127.0.0.1" in message and not told[0].exc_info


def test_stop_closes_every_connection_and_leaves_no_thread() -> None:
    server = HttpServer("127.0.0.1", 0, echo, name="stopping")
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    half = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        assert post(conn, b"{}") == b"2"  # a worker has run
        half.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        wait_until(lambda: server.open_connections == 2, what="both connections taken in")
        server.stop()
        assert conn.sock is not None and closed_by_server(conn.sock) and closed_by_server(half)
        wait_until(
            lambda: not [t for t in threading.enumerate() if t.name.startswith("stopping-")], what="its threads gone"
        )
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=10)
    finally:
        server.stop()
        conn.close()
        half.close()


class BrokenTLS:
    """TLS settings that fail when a connection asks for them, as a bug would."""

    def context(self) -> ssl.SSLContext:
        raise RuntimeError("no context")


def test_a_server_whose_loop_fails_says_so_and_leaves_nothing_behind(caplog: pytest.LogCaptureFixture) -> None:
    server = HttpServer("127.0.0.1", 0, echo, tls=BrokenTLS(), name="failing")  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.ERROR, logger="gpushare.tlshttp"):
            server.start()
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                assert closed_by_server(sock)
            wait_until(
                lambda: not [t for t in threading.enumerate() if t.name.startswith("failing-")], what="no threads"
            )
        assert "failing: the server failed" in caplog.text and "no context" in caplog.text
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=10)
    finally:
        server.stop()


# --- JSON bodies ---------------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b'{"a": ' * (depth - 1) + b"[1]" + b"}" * (depth - 1)


@pytest.mark.parametrize(
    "body",
    [
        nested(MAX_JSON_DEPTH),
        # brackets inside strings are text, escaped quotes and backslashes included
        b'{"a": "[[[[' + b"[" * 100 + b'", "b": "\\\\", "c": "\\"[[[["}',
        b'["' + b"]" * 100 + b'", ' + nested(MAX_JSON_DEPTH - 1) + b"]",
        b'[[], {}, "", "", [[]], {"x": [{}]}]',
    ],
)
def test_json_nested_up_to_the_limit_is_parsed_as_json_loads_does(body: bytes) -> None:
    assert parse_json(body) == json.loads(body)


@pytest.mark.parametrize(
    "body",
    [
        nested(MAX_JSON_DEPTH + 1),
        b"[" * 5000,  # never closed
        b"{" * 100_000 + b"}" * 100_000,
        b"[" + b'"]", [' * 5000,  # closers hidden in strings
        b"[]" * 10 + b"[" * 70,
    ],
)
def test_json_nested_deeper_is_refused_before_it_is_decoded(body: bytes) -> None:
    with pytest.raises(BadJSON, match=f"nests more than {MAX_JSON_DEPTH} arrays and objects deep"):
        parse_json(body)


def test_a_body_that_is_not_json_is_refused_saying_so() -> None:
    for body in (b"", b"{", b"\xff\xfe[", b'{"a": 1} x'):
        with pytest.raises(BadJSON, match="the body is not JSON"):
            parse_json(body)


# --- a handler's failures ------------------------------------------------------------------------


def test_a_handler_failing_again_and_again_is_a_500_logged_once_per_kind(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that trips a bug, repeated by a peer, is answered 500 every time and logged one line per
    kind (the exception and where it was raised) per interval, then with how many were left out."""
    now = [1000.0]
    monkeypatch.setattr(tlshttp, "time", SimpleNamespace(monotonic=lambda: now[0]))

    def broken(request: Request) -> Reply:
        if request.path == "/key":
            return Reply(200, {}["secret-key"])
        raise RuntimeError("no such thing")

    server = HttpServer("127.0.0.1", 0, broken, name="broken")
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        with caplog.at_level(logging.INFO, logger="gpushare.tlshttp"):
            for path in ["/key", "/other"] * 20:
                conn.request("POST", path, b"{}")
                reply = conn.getresponse()
                assert reply.status == 500 and b"secret-key" not in reply.read()
            first = [r for r in caplog.records if r.levelno >= logging.INFO]
            assert len(first) == 2 and not any(r.exc_info for r in first), caplog.text
            key, other = (r.getMessage() for r in first)
            assert (
                "broken: POST '/key' failed: KeyError" in key and "test_http_server.py:" in key and "in broken" in key
            )
            assert "broken: POST '/other' failed: RuntimeError: 'no such thing'" in other
            now[0] += LOG_EVERY
            conn.request("POST", "/key", b"{}")
            assert conn.getresponse().read()
        later = [r.getMessage() for r in caplog.records[len(first) :]]
        assert len(later) == 1 and "KeyError" in later[0] and "(19 more like it in the last 10 s)" in later[0]
    finally:
        conn.close()
        server.stop()
