"""Throw-away certificates made with the openssl command line tool: a CA, a server certificate it signed
for loopback and the given DNS names, a client certificate it signed, and a self-signed stranger that
no server here trusts. The sandbox cluster and the tests use them for every TLS hop they set up."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


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


#: below a cluster's directory: the CA its kubelets trust for clients, and kube-apiserver's client pair
KUBELET_CLIENT_DIR = "kubelet-client"


def kubelet_client_ca(workdir: Path) -> Path:
    """The CA a cluster's kubelets take clients' certificates from (their only way in)."""
    return workdir / KUBELET_CLIENT_DIR / "ca.crt"


def make_kubelet_client(workdir: Path) -> Pair:
    """kube-apiserver's client certificate for the kubelets (``logs``, ``exec``), signed by a CA of its
    own, :func:`kubelet_client_ca`."""
    directory = workdir / KUBELET_CLIENT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    ca = _self_signed(directory, "ca", "/CN=gpushare-kubelet-client-ca")
    return _signed(directory, "apiserver", "/CN=kube-apiserver-kubelet-client", ca, "extendedKeyUsage=clientAuth\n")


def make_front_proxy_ca(workdir: Path) -> Path:
    """The CA kube-apiserver takes authenticating proxies' client certificates from
    (``--requestheader-client-ca-file``, kubeadm's front-proxy CA); no proxy here holds one."""
    directory = workdir / "front-proxy"
    directory.mkdir(parents=True, exist_ok=True)
    return Path(_self_signed(directory, "ca", "/CN=gpushare-front-proxy-ca").cert)


def make_certs(
    directory: Path, server_names: tuple[str, ...] = ("localhost",), client_name: str = "kube-scheduler"
) -> Certs:
    """Everything in ``directory`` (made if missing); the server certificate also names IP 127.0.0.1."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _self_signed(directory, "ca", "/CN=gpushare-test-ca")
    alt = ",".join([*(f"DNS:{n}" for n in server_names), "IP:127.0.0.1"])
    server = _signed(
        directory, "server", "/CN=gpushare-server", ca, f"subjectAltName={alt}\nextendedKeyUsage=serverAuth\n"
    )
    client = _signed(directory, "client", f"/CN={client_name}", ca, "extendedKeyUsage=clientAuth\n")
    stranger = _self_signed(directory, "stranger", f"/CN={client_name}")
    return Certs(ca.cert, server, client, stranger)
