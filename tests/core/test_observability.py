"""/metrics, /healthz and /readyz: plain HTTP that kubelet's probes and Prometheus read, so it listens
only where the operator says (loopback unless told) and half-sent requests cost it neither threads nor
memory beyond a bound; they are dropped after the read timeout while probes keep their answers."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import wait_until

from gpushare.observability import LIMITS, serve_http
from gpushare.sandbox.launch import free_port
from gpushare.settings import MetricsEndpoint


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def healthz(host: str, port: int) -> int:
    with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as reply:
        return reply.status


def closed_unanswered(sock: socket.socket) -> bool:
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:  # closed with the request unread
        return True


def test_half_sent_requests_hold_neither_threads_nor_memory_and_are_dropped() -> None:
    server = serve_http(MetricsEndpoint("127.0.0.1", 0), lambda: True)
    socks: list[socket.socket] = []
    threads, memory = threading.active_count(), rss_kib()
    try:
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line that ends it
            socks.append(sock)
        wait_until(lambda: server.open_connections == LIMITS.max_connections, what="the server to take them in")
        assert healthz("127.0.0.1", server.port) == 200  # a probe still gets through
        server_threads = [t for t in threading.enumerate() if t.name.startswith("observability-")]
        assert len(server_threads) <= 1 + LIMITS.workers, [t.name for t in server_threads]
        assert threading.active_count() <= threads + LIMITS.workers + 4
        assert rss_kib() - memory < 16 << 10  # KiB; a thread per request took about 60 KiB each
        # the server gives up on each by itself, answering nothing
        wait_until(lambda: server.open_connections == 0, timeout=LIMITS.read_timeout + 5, what="them dropped")
        assert all(closed_unanswered(sock) for sock in socks[-LIMITS.max_connections :])
    finally:
        for sock in socks:
            sock.close()
        server.stop()


#: each command that serves /healthz, as run here, with the flag naming its address
COMMANDS = {
    "node": (["node", "--gpus", "sim:1xT4:15360", "--no-cri-shim", "--device-plugin-dir", "{dir}"], "--metrics"),
    "device-plugin": (["device-plugin", "--gpus", "sim:1xT4:15360", "--device-plugin-dir", "{dir}"], "--metrics"),
    "cri-shim": (
        [
            "cri-shim",
            "--gpus",
            "sim:1xT4:15360",
            "--no-api-fetch",
            "--listen",
            "unix://{dir}/cri.sock",
            "--runtime",
            "unix://{dir}/runtime.sock",
        ],
        "--metrics",
    ),
    "extender": (["extender", "--port", "0"], "--health"),
}


@contextlib.contextmanager
def running(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpushare.cli", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("told", ["127.0.0.2", None], ids=["told", "default"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_health_listens_where_the_operator_says_and_on_loopback_unless_told(
    command: str, told: str | None, kubeconfig: Path, directory: Path
) -> None:
    argv, prefix = COMMANDS[command]
    port = free_port()
    argv = [part.format(dir=directory) for part in argv]
    argv += ["--kubeconfig", str(kubeconfig), f"{prefix}-port", str(port)]
    if command != "extender":
        argv += ["--node-name", "n1"]
    if told:
        argv += [f"{prefix}-host", told]
    where, elsewhere = (told, "127.0.0.1") if told else ("127.0.0.1", "127.0.0.2")
    with running(argv) as proc:

        def answering() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            with contextlib.suppress(OSError):
                return healthz(where, port) == 200
            return False

        wait_until(answering, timeout=30, what=f"gpushare {command} to answer on {where}")
        assert refused(elsewhere, port)


def test_a_listen_address_that_is_not_an_ip_is_refused_before_anything_starts() -> None:
    """As when the downward API's variable is missing from the pod spec."""
    done = subprocess.run(
        [sys.executable, "-m", "gpushare.cli", "node", "--metrics-host", "$(POD_IP)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--metrics-host: '$(POD_IP)' is not an IP address" in done.stderr
