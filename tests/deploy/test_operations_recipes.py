"""The recipes of docs/operations.md, run as an operator would run them: the certificates the
openssl commands make are served and checked by gpushare's own TLS server, and the caBundle command
fills in deploy/webhook.yaml."""

from __future__ import annotations

import base64
import re
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import pytest
import yaml

from gpushare.tlshttp import HttpServer, Reply, Request, ServerTLS

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
EXTENDER_NAME = "gpushare-extender.gpushare-system.svc"
WEBHOOK_NAME = "gpushare-webhook.gpushare-system.svc"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the recipes need the openssl command")


def bash_block(first_line: str) -> str:
    """The fenced bash block of docs/operations.md that starts with ``first_line``."""
    blocks = re.findall(r"```bash[^\n]*\n(.*?)```", OPERATIONS.read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith(first_line)]
    return block


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    script = bash_block("# certificates for gpushare")
    proc = subprocess.run(["bash", "-c", script], cwd=directory, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return directory


def ok(_: Request) -> Reply:
    return Reply(200, b"ok\n", "text/plain")


def client(ca: Path, pair: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.verify_flags |= ssl.VERIFY_X509_STRICT  # what newer Pythons check by default
    if pair is not None:
        context.load_cert_chain(*map(str, pair))
    return context


def get(port: int, context: ssl.SSLContext, name: str) -> int:
    """The status of ``GET /healthz`` over TLS to ``name`` at the loopback ``port``; 0 when the server
    refuses the connection (TLS 1.3 refuses a client certificate after the client's handshake)."""
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=name) as sock,
        ):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status = sock.recv(64).split()
    except (ssl.SSLError, ConnectionError):
        return 0
    return int(status[1]) if len(status) > 1 else 0


def test_the_scheduler_reaches_the_extender_with_its_client_certificate_and_nobody_else_does(certs: Path) -> None:
    tls = ServerTLS(str(certs / "extender.crt"), str(certs / "extender.key"), str(certs / "scheduler-client-ca.crt"))
    server = HttpServer("127.0.0.1", 0, ok, tls=tls, name="extender")
    server.start()
    try:
        scheduler = client(certs / "extender-ca.crt", (certs / "scheduler-client.crt", certs / "scheduler-client.key"))
        assert get(server.port, scheduler, EXTENDER_NAME) == 200
        assert get(server.port, client(certs / "extender-ca.crt"), EXTENDER_NAME) == 0
        # a certificate from another CA is no client certificate here
        stranger = client(certs / "extender-ca.crt", (certs / "webhook.crt", certs / "webhook.key"))
        assert get(server.port, stranger, EXTENDER_NAME) == 0
    finally:
        server.stop()


def test_the_api_server_trusts_the_webhook_through_the_filled_in_ca_bundle(certs: Path, tmp_path: Path) -> None:
    (command,) = [line for line in OPERATIONS.read_text().splitlines() if "caBundle: $(base64" in line]
    fill = command.strip().split(" && kubectl")[0]
    (tmp_path / "deploy").mkdir()
    shutil.copy(ROOT / "deploy" / "webhook.yaml", tmp_path / "deploy" / "webhook.yaml")
    shutil.copy(certs / "webhook-ca.crt", tmp_path / "webhook-ca.crt")
    subprocess.run(["bash", "-c", fill], cwd=tmp_path, check=True, timeout=30)
    config = next(
        d
        for d in yaml.safe_load_all((tmp_path / "webhook.yaml").read_text())
        if d["kind"] == "ValidatingWebhookConfiguration"
    )
    (hook,) = config["webhooks"]
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(base64.b64decode(hook["clientConfig"]["caBundle"], validate=True))
    server = HttpServer(
        "127.0.0.1", 0, ok, tls=ServerTLS(str(certs / "webhook.crt"), str(certs / "webhook.key")), name="webhook"
    )
    server.start()
    try:
        assert get(server.port, client(bundle), WEBHOOK_NAME) == 200
    finally:
        server.stop()
