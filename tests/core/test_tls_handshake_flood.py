"""The extender's and the webhook's port under the slow-handshake attack: peers without credentials
that start TLS handshakes and never finish them, a byte at a time, must not keep kube-scheduler (which
has a client certificate, a 10 s TLS handshake timeout and 5 s for prioritize) or the API server from
being answered; at the connection cap the newcomer wins over the oldest unproven peer; and what the
attack provokes is logged a line at a time, not per connection. Everything stays on loopback."""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import wait_until
from tlscerts import Certs, make_certs

from gpushare.tlshttp import DEFAULT_LIMITS, HttpServer, Limits, Reply, ServerTLS

#: kube-scheduler's tightest extender timeout in deploy/scheduler-config.yaml (prioritize-host)
SCHEDULER_TIMEOUT = 5.0


def client_hello() -> bytes:
    """The first flight of a real TLS client."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


class SlowHandshakes:
    """``count`` connections that each send a real ClientHello one byte every ``every`` seconds, from a
    thread that stops by itself after ``lasting`` seconds (or when the block ends)."""

    def __init__(self, port: int, count: int, every: float, lasting: float = 20.0) -> None:
        self._port = port
        self._count = count
        self._every = every
        self._lasting = lasting
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._trickle, name="slow-handshakes", daemon=True)

    def __enter__(self) -> SlowHandshakes:
        for _ in range(self._count):
            sock = socket.create_connection(("127.0.0.1", self._port), timeout=5)
            sock.sendall(b"\x16")  # a TLS handshake record begins
            self._socks.append(sock)
        self._thread.start()
        return self

    def _trickle(self) -> None:
        hello = client_hello()
        end = time.monotonic() + self._lasting
        sent = 1
        while not self._stop.wait(self._every) and time.monotonic() < end and sent < len(hello):
            for sock in self._socks:
                with contextlib.suppress(OSError):  # the server gave up on this one
                    sock.send(hello[sent : sent + 1])
            sent += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self._socks:
            sock.close()


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path)


@contextlib.contextmanager
def serving(tls: ServerTLS, limits: Limits = DEFAULT_LIMITS) -> Iterator[HttpServer]:
    server = HttpServer("127.0.0.1", 0, lambda request: Reply(200, b'{"Error": ""}'), tls=tls, limits=limits)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def timed_post(port: int, context: ssl.SSLContext) -> float:
    """One request on a new connection, as kube-scheduler makes it; its seconds, handshake included.
    Fails (TimeoutError) when it takes longer than kube-scheduler would wait."""
    started = time.monotonic()
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=SCHEDULER_TIMEOUT)
    try:
        conn.request("POST", "/filter", b"{}", {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200 and reply.read() == b'{"Error": ""}'
    finally:
        conn.close()
    return time.monotonic() - started


def client_context(certs: Certs, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certs.ca)
    if with_certificate:
        context.load_cert_chain(certs.client.cert, certs.client.key)
    return context


@pytest.mark.parametrize("client_auth", [True, False], ids=["extender-mutual-tls", "webhook-server-tls"])
def test_slow_handshakes_do_not_keep_the_server_from_answering(certs: Certs, client_auth: bool) -> None:
    """16 silent handshakes, twice the workers, with the limits the extender runs with."""
    tls = ServerTLS(certs.server.cert, certs.server.key, certs.ca if client_auth else None)
    with serving(tls) as server, SlowHandshakes(server.port, 16, every=1.0):
        wait_until(lambda: server.open_connections == 16, what="the server to take the 16 handshakes in")
        seconds = [timed_post(server.port, client_context(certs, client_auth)) for _ in range(8)]
        assert max(seconds) < SCHEDULER_TIMEOUT, seconds
        assert server.open_connections >= 16  # the attack was still on throughout


def test_at_the_connection_cap_a_newcomer_takes_the_place_of_the_oldest_silent_peer(
    certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    limits = Limits(max_connections=32)
    tls = ServerTLS(certs.server.cert, certs.server.key, certs.ca)
    with (
        caplog.at_level(logging.INFO, logger="gpushare.tlshttp"),
        serving(tls, limits) as server,
        SlowHandshakes(server.port, 96, every=1.0),  # three times the cap
    ):
        wait_until(lambda: server.open_connections == 32, what="the attack to hold the cap")
        for _ in range(10):
            timed_post(server.port, client_context(certs, True))
        assert server.open_connections <= limits.max_connections
    told = [r for r in caplog.records if r.name == "gpushare.tlshttp" and r.levelno >= logging.INFO]
    # 74 connections made room: the first is logged, the rest are counted in the next line
    assert len(told) == 1, [r.getMessage() for r in told]
    assert "closing the oldest unproven one" in told[0].getMessage()


def test_a_handshake_sent_a_byte_at_a_time_is_dropped_after_the_read_timeout(certs: Certs) -> None:
    limits = Limits(read_timeout=0.5)
    tls = ServerTLS(certs.server.cert, certs.server.key, certs.ca)
    with serving(tls, limits) as server, SlowHandshakes(server.port, 4, every=0.05, lasting=10.0):
        wait_until(lambda: server.open_connections == 4, what="the server to take the handshakes in")
        # still trickling (the whole ClientHello would take 10 s more) when the server gives up on them
        wait_until(lambda: server.open_connections == 0, timeout=3, what="the slow handshakes dropped")


def test_at_the_cap_the_schedulers_idle_connection_outlives_the_attack(certs: Certs) -> None:
    """kube-scheduler's keep-alive connection, its certificate verified, idle between two requests while
    the attack fills the cap three times over, is still open for the next one."""
    limits = Limits(max_connections=8)
    tls = ServerTLS(certs.server.cert, certs.server.key, certs.ca)
    with serving(tls, limits) as server:
        scheduler = http.client.HTTPSConnection(
            "127.0.0.1", server.port, context=client_context(certs, True), timeout=SCHEDULER_TIMEOUT
        )

        def ask() -> object:
            """Where the answer came to."""
            scheduler.request("POST", "/filter", b"{}", {"Content-Type": "application/json"})
            reply = scheduler.getresponse()
            assert reply.status == 200 and reply.read() == b'{"Error": ""}'
            assert scheduler.sock is not None
            return scheduler.sock.getsockname()

        try:
            where = ask()
            with SlowHandshakes(server.port, 3 * limits.max_connections, every=1.0):
                wait_until(lambda: server.open_connections == limits.max_connections, what="the attack to hold the cap")
                assert ask() == where  # the same connection
        finally:
            scheduler.close()
