"""Throw-away certificates for TLS tests (see :mod:`gpushare.sandbox.certs`); skipped without openssl."""

from __future__ import annotations

import ipaddress
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpushare.sandbox.certs import Certs, Pair
from gpushare.sandbox.certs import make_certs as _make_certs

__all__ = ["Certs", "Pair", "make_certs", "server_pair_valid"]


def make_certs(directory: Path, server_names: tuple[str, ...] = ("localhost",)) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    return _make_certs(directory, server_names)


def server_pair_valid(certs: Certs, valid_from: datetime, valid_to: datetime, directory: Path) -> Pair:
    """A server certificate for localhost and 127.0.0.1 signed by ``certs``' CA, valid only from
    ``valid_from`` to ``valid_to`` (an expired one, or one not valid yet), and its key, in ``directory``."""
    ca_cert = x509.load_pem_x509_certificate(Path(certs.ca).read_bytes())
    ca_key = serialization.load_pem_private_key(Path(certs.ca).with_suffix(".key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    names = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.IPv4Address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpushare-server")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(names, critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    directory.mkdir(parents=True, exist_ok=True)
    pair = Pair(str(directory / "server.crt"), str(directory / "server.key"))
    Path(pair.cert).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    Path(pair.key).write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pair
