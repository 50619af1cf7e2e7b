"""The extender's and the webhook's TLS follow their Secret: Kubernetes swaps the mounted files all at
once (a ``..data`` symlink), and the next connection is served with the new certificate; a pair that
doesn't load leaves the old one serving."""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import ssl
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from support.waiting import wait_until
from tlscerts import Certs, Pair, make_certs, server_pair_valid

from gpushare.tlshttp import HttpServer, Reply, ServerTLS

FILES = ("tls.crt", "tls.key")


class SecretMount:
    """A directory laid out as kubelet mounts a Secret: each file a symlink through ``..data`` to a
    timestamped directory, which a rotation replaces by swapping ``..data``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions = 0
        root.mkdir()
        for name in FILES:
            (root / name).symlink_to(Path("..data") / name)

    def publish(self, cert: bytes, key: bytes) -> None:
        self.versions += 1
        version = self.root / f"..v{self.versions}"
        version.mkdir()
        (version / "tls.crt").write_bytes(cert)
        (version / "tls.key").write_bytes(key)
        link = self.root / "..data_tmp"
        link.symlink_to(version.name)
        os.replace(link, self.root / "..data")

    def path(self, name: str) -> str:
        return str(self.root / name)


def pair(certs: Certs) -> tuple[bytes, bytes]:
    return Path(certs.server.cert).read_bytes(), Path(certs.server.key).read_bytes()


def status(port: int, ca: str) -> int:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ssl.create_default_context(cafile=ca), timeout=10)
    try:
        conn.request("GET", "/")
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[SecretMount, Certs, HttpServer]]:
    old = make_certs(tmp_path / "old")
    mount = SecretMount(tmp_path / "secret")
    mount.publish(*pair(old))
    server = HttpServer(
        "127.0.0.1", 0, lambda request: Reply(200, b"{}"), tls=ServerTLS(mount.path("tls.crt"), mount.path("tls.key"))
    )
    server.start()
    try:
        yield mount, old, server
    finally:
        server.stop()


def test_a_new_connection_gets_the_rotated_certificate(
    mounted: tuple[SecretMount, Certs, HttpServer], tmp_path: Path
) -> None:
    mount, old, server = mounted
    assert status(server.port, old.ca) == 200
    new = make_certs(tmp_path / "new")  # a new CA too
    mount.publish(*pair(new))
    assert status(server.port, new.ca) == 200
    with pytest.raises(ssl.SSLCertVerificationError):
        status(server.port, old.ca)


@pytest.mark.parametrize("broken", ["key-of-another-pair", "half-written-certificate"])
def test_a_pair_that_does_not_load_leaves_the_old_certificate_serving(
    mounted: tuple[SecretMount, Certs, HttpServer], tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    mount, old, server = mounted
    new = make_certs(tmp_path / "new")
    cert, key = pair(new)
    if broken == "key-of-another-pair":
        key = pair(make_certs(tmp_path / "other"))[1]
    else:
        cert = cert[: len(cert) // 2]
    with caplog.at_level(logging.ERROR, logger="gpushare.tlshttp"):
        mount.publish(cert, key)
        assert status(server.port, old.ca) == 200
    assert f"TLS certificate {mount.path('tls.crt')}" in caplog.text and "still serving" in caplog.text
    # once the Secret is mended, the next connection takes it
    mount.publish(*pair(new))
    assert status(server.port, new.ca) == 200


def publish_refused(
    refused: Pair, mounted: tuple[SecretMount, Certs, HttpServer], caplog: pytest.LogCaptureFixture
) -> str:
    """Publish a pair the server must refuse: the old certificate keeps serving. What was logged."""
    mount, old, server = mounted
    with caplog.at_level(logging.ERROR, logger="gpushare.tlshttp"):
        mount.publish(Path(refused.cert).read_bytes(), Path(refused.key).read_bytes())
        assert status(server.port, old.ca) == 200
    return caplog.text


def test_an_expired_pair_leaves_the_old_certificate_serving(
    mounted: tuple[SecretMount, Certs, HttpServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mount, _, server = mounted
    new = make_certs(tmp_path / "new")
    now = datetime.now(UTC).replace(microsecond=0)
    expired = server_pair_valid(new, now - timedelta(days=30), now - timedelta(days=1), tmp_path / "expired")
    assert (
        f"TLS certificate {mount.path('tls.crt')} has expired: valid from {now - timedelta(days=30):%Y-%m-%d %H:%M:%S} "
        f"to {now - timedelta(days=1):%Y-%m-%d %H:%M:%S} UTC; still serving the certificate loaded before"
    ) in publish_refused(expired, mounted, caplog)
    mount.publish(*pair(new))
    assert status(server.port, new.ca) == 200


def test_a_pair_not_valid_yet_is_served_once_it_is(
    mounted: tuple[SecretMount, Certs, HttpServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As when the issuer's clock is ahead: refused until its start, then taken without the files changing."""
    mount, _, server = mounted
    new = make_certs(tmp_path / "new")
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=3)
    early = server_pair_valid(new, start, start + timedelta(days=1), tmp_path / "early")
    logged = publish_refused(early, mounted, caplog)
    assert f"TLS certificate {mount.path('tls.crt')} is not valid yet: valid from {start:%Y-%m-%d %H:%M:%S}" in logged
    wait_until(lambda: status_or_none(server.port, new.ca) == 200, timeout=15, what="the pair to be taken once valid")


def status_or_none(port: int, ca: str) -> int | None:
    try:
        return status(port, ca)
    except ssl.SSLCertVerificationError:
        return None


def test_an_expired_pair_at_start_names_the_file_and_its_dates(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "c")
    now = datetime.now(UTC).replace(microsecond=0)
    expired = server_pair_valid(certs, now - timedelta(days=3), now - timedelta(days=2), tmp_path / "expired")
    with pytest.raises(ValueError, match=f"TLS certificate {expired.cert} has expired: valid from .* to .* UTC"):
        ServerTLS(expired.cert, expired.key)


def test_unloadable_files_at_start_name_the_file(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "c")
    missing = tmp_path / "missing.crt"
    with pytest.raises(ValueError, match=f"TLS certificate {missing}"):
        ServerTLS(str(missing), certs.server.key)
    bad_ca = tmp_path / "ca.crt"
    shutil.copy(certs.server.key, bad_ca)
    with pytest.raises(ValueError, match=f"TLS client CA {bad_ca}"):
        ServerTLS(certs.server.cert, certs.server.key, str(bad_ca))
