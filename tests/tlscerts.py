"""Throw-away certificates for TLS tests, made with the openssl command line tool."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class Certs:
    ca: str
    server: Pair
    #: signed by ``ca``
    client: Pair
    #: self-signed: a client the server must not trust
    stranger: Pair


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _signed(directory: Path, name: str, subject: str, ca: Pair, extensions: str) -> Pair:
    key, csr, cert, ext = (directory / f"{name}.{suffix}" for suffix in ("key", "csr", "crt", "ext"))
    ext.write_text(extensions)
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", subject)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
        "-days", "2", "-out", str(cert), "-extfile", str(ext),
    )  # fmt: skip
    return Pair(str(cert), str(key))


def _self_signed(directory: Path, name: str, subject: str) -> Pair:
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
        "-days", "2", "-subj", subject, "-addext", "basicConstraints=critical,CA:TRUE",
    )  # fmt: skip
    return Pair(str(cert), str(key))


def make_certs(directory: Path, server_names: tuple[str, ...] = ("localhost",)) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    ca = _self_signed(directory, "ca", "/CN=gpushare-test-ca")
    alt = ",".join([*(f"DNS:{n}" for n in server_names), "IP:127.0.0.1"])
    server = _signed(
        directory, "server", "/CN=gpushare-server", ca, f"subjectAltName={alt}\nextendedKeyUsage=serverAuth\n"
    )
    client = _signed(directory, "client", "/CN=kube-scheduler", ca, "extendedKeyUsage=clientAuth\n")
    stranger = _self_signed(directory, "stranger", "/CN=kube-scheduler")
    return Certs(ca.cert, server, client, stranger)
