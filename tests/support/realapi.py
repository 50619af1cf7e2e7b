"""A real kube-apiserver (with etcd) for tests of what the API server itself accepts and does."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, utils

from gpushare.sandbox import binaries
from gpushare.sandbox.realcluster import RealCluster

DEVICE_CLASS = Path(__file__).resolve().parents[2] / "deploy" / "dra" / "deviceclass.yaml"


def real_api_unavailable() -> str | None:
    """None when etcd and kube-apiserver can run here, else why not."""
    return binaries.missing(("kube-apiserver", "kube-controller-manager", "etcd")) or binaries.host_tool_missing(
        ("openssl",)
    )


@contextlib.contextmanager
def real_api_server(rbac: bool = False) -> Iterator[RealCluster]:
    """etcd and kube-apiserver alone (see :meth:`RealCluster.start_api_server`), stopped and removed on the
    way out; skips the test when they can't run here. With ``rbac`` it authorizes with RBAC and the
    gpushare components' accounts have deploy/rbac.yaml's roles (``real.kubeconfig_of(account)``)."""
    if reason := real_api_unavailable():
        pytest.skip(f"no real kube-apiserver here: {reason}")
    workdir = Path(tempfile.mkdtemp(prefix="gs-api-", dir="/tmp"))
    real = RealCluster((), workdir, rbac=rbac)
    try:
        real.start_api_server()
        yield real
    finally:
        real.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def dra_api_server() -> Iterator[client.ApiClient]:
    """:func:`real_api_server` with gpushare's DeviceClass (``deploy/dra/deviceclass.yaml``) applied, ready
    for claims in namespace ``default``."""
    with real_api_server() as real:
        real.wait_default_service_account("default")
        utils.create_from_yaml(real.api, str(DEVICE_CLASS))
        yield real.api
