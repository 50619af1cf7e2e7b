"""The extender's port: who may call it (TLS with kube-scheduler's client certificate), what it does
with floods, oversized and half-sent bodies, and how it answers bad input and its own bugs."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import threading
from pathlib import Path

import pytest
from gpushare.extender.wiring import Serving, start_extender
from kubernetes import client
from podfactory import container, gpu_pod
from support.extender import NODES, Cluster
from support.waiting import wait_until
from tlscerts import Certs, make_certs

from gpushare.settings import UsageError
from gpushare.tlshttp import Limits, ServerTLS


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path)


def _post(port: int, path: str, body: bytes, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
        if context is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    )
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _client_context(certs: Certs, pair: tuple[str, str] | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certs.ca)
    if pair is not None:
        context.load_cert_chain(*pair)
    return context


# --- TLS, and only kube-scheduler's certificate gets in ------------------------------------


def test_verbs_answer_only_a_client_holding_the_schedulers_certificate(
    cluster: Cluster, certs: Certs, kube_api: client.ApiClient
) -> None:
    tls = ServerTLS(certs.server.cert, certs.server.key, certs.ca)
    secure = start_extender(kube_api, 0, "binpack", serving=Serving(0, tls=tls, host="127.0.0.1"))
    try:
        pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
        body = json.dumps({"Pod": pod, "NodeNames": list(NODES)}).encode()
        port = secure.server.port
        status, reply = _post(port, "/filter", body, _client_context(certs, (certs.client.cert, certs.client.key)))
        assert status == 200 and json.loads(reply)["NodeNames"] == ["n1", "n2"]
        for who in (None, (certs.stranger.cert, certs.stranger.key)):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                _post(port, "/bind", b"{}", _client_context(certs, who))
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            _post(port, "/filter", body)  # plain HTTP to the TLS port
    finally:
        secure.stop()


def test_plain_http_is_refused_anywhere_but_loopback(kube_api: client.ApiClient) -> None:
    with pytest.raises(UsageError, match="only served on loopback"):
        start_extender(kube_api, 0, "binpack", host="0.0.0.0")


# --- limits, timeouts, a bounded pool -----------------------------------------------------------


def _send_head(port: int, length: int, first_bytes: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = f"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
    sock.sendall(head.encode() + first_bytes)
    return sock


def test_oversized_bodies_are_refused_before_they_are_read(cluster: Cluster) -> None:
    """32 clients announce 50 MB each and send none of it: each gets 413 at once."""
    socks = [_send_head(cluster.extender.server.port, 50_000_000) for _ in range(32)]
    try:
        for sock in socks:
            assert sock.recv(200).startswith(b"HTTP/1.1 413 ")
    finally:
        for sock in socks:
            sock.close()


def test_half_sent_bodies_hold_neither_threads_nor_connections(kube_api: client.ApiClient) -> None:
    """Each waits for its body in a worker at most read_timeout; the workers are a fixed few."""
    limits = Limits(read_timeout=0.2, workers=8)
    running = start_extender(kube_api, 0, "binpack", serving=Serving(0, host="127.0.0.1", limits=limits))
    baseline = threading.active_count()
    socks: list[socket.socket] = []
    try:
        port = running.server.port
        socks = [_send_head(port, 1000, b'{"Pod": ') for _ in range(200)]
        # every connection has been taken in, and is waiting for the rest of its body
        wait_until(lambda: running.server.open_connections == 200, what="the server to accept all 200")
        # the server's own threads (its loop and its worker pool), whatever other tests left running
        server_threads = [t for t in threading.enumerate() if t.name.startswith(("extender-loop", "extender-worker"))]
        assert len(server_threads) <= 1 + limits.workers, [t.name for t in server_threads]
        # and nothing else grew with the 200 connections (a few threads of other tests may come and go)
        assert threading.active_count() <= baseline + limits.workers + 4
        # the server gives up on each by itself, answering nothing
        wait_until(lambda: running.server.open_connections == 0, timeout=20, what="the half-sent bodies dropped")
        assert all(sock.recv(100) == b"" for sock in socks)
        status, _ = _post(port, "/filter", json.dumps({"Pod": {}, "NodeNames": []}).encode())
        assert status == 200
    finally:
        for sock in socks:
            sock.close()
        running.stop()


def test_a_body_without_content_length_is_refused(cluster: Cluster) -> None:
    sock = socket.create_connection(("127.0.0.1", cluster.extender.server.port), timeout=10)
    with sock:
        sock.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{}...\r\n")
        assert sock.recv(200).startswith(b"HTTP/1.1 411 ")


# --- 400 for bad input, 500 (logged) for bugs ----------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"Pod": {"metadata": "x"}, "NodeNames": ["n1"]},
        {"Pod": {"spec": {"containers": ["main"]}}, "NodeNames": ["n1"]},
        {"Pod": {"spec": {"containers": [{"name": "m", "resources": {"limits": []}}]}}, "NodeNames": ["n1"]},
        {"Pod": {}, "Nodes": {"items": ["n1"]}},
    ],
)
def test_a_body_of_the_wrong_shape_is_a_400_naming_the_field(cluster: Cluster, body: dict) -> None:
    status, reply = _post(cluster.extender.server.port, "/filter", json.dumps(body).encode())
    assert status == 400 and "must be" in json.loads(reply)["Error"]


def test_a_preempt_body_of_the_wrong_shape_is_a_400(cluster: Cluster) -> None:
    body = {"Pod": {}, "NodeNameToMetaVictims": {"n1": {"Pods": ["uid-1"]}}}
    status, reply = _post(cluster.extender.server.port, "/preempt", json.dumps(body).encode())
    assert status == 400 and "NodeNameToMetaVictims" in json.loads(reply)["Error"]


def test_a_bug_is_a_logged_500_without_python_details(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_args: object) -> None:
        raise AttributeError("'str' object has no attribute 'get'")

    monkeypatch.setattr("gpushare.extender.server.filter_result", broken)
    with caplog.at_level(logging.ERROR):
        for _ in range(20):
            status, reply = _post(cluster.extender.server.port, "/filter", b'{"Pod": {}, "NodeNames": []}')
            assert status == 500 and "attribute" not in reply.decode()
    # one line for the lot, naming the exception and where it was raised
    [told] = caplog.records
    assert not told.exc_info and "extender: POST '/filter' failed: AttributeError" in told.getMessage()
    assert "test_extender_server.py:" in told.getMessage()


def test_a_flood_of_deeply_nested_json_is_a_400_each_and_the_extender_keeps_serving(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", cluster.extender.server.port, timeout=10)
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(300):
                conn.request("POST", "/filter", b"[" * 5000, {"Content-Type": "application/json"})
                reply = conn.getresponse()
                assert reply.status == 400
                assert "nests more than 64 arrays and objects deep" in json.loads(reply.read())["Error"]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
        conn.request("POST", "/filter", json.dumps({"Pod": pod, "NodeNames": ["n1"]}).encode())
        reply = conn.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["NodeNames"] == ["n1"]
    finally:
        conn.close()


def test_binds_waiting_on_the_api_server_never_hold_up_filter(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kube-scheduler filters one pod at a time while the binds of earlier pods are under way: with more
    binds stuck than the server has workers, a filter still answers at once."""
    stuck = threading.Event()
    entered = threading.Semaphore(0)

    def bind(*_args: object) -> None:
        entered.release()
        stuck.wait(60)

    monkeypatch.setattr(cluster.extender.binder, "bind", bind)
    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    binds = [threading.Thread(target=cluster.bind, args=(pod, "n1")) for _ in range(Limits().workers + 4)]
    for thread in binds:
        thread.start()
    try:
        for _ in range(Limits().slow_workers):  # every bind worker is taken
            assert entered.acquire(timeout=10)
        # within _post's 10 s, while every bind is still stuck
        status, body = _post(
            cluster.extender.server.port, "/filter", json.dumps({"Pod": pod, "NodeNames": ["n1"]}).encode()
        )
        assert status == 200 and json.loads(body)["NodeNames"] == ["n1"]
    finally:
        stuck.set()
        for thread in binds:
            thread.join(30)
