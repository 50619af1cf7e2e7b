"""Shared fixtures: a fresh API server stand-in per test, reached through the official client, and a
kubelet emulator in a private device-plugins directory.

Plain helpers live in tests/support, not here: a folder with its own conftest.py replaces the module
named ``conftest`` while the tests run, so ``from conftest import ...`` would find the wrong one."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from gpushare.kube.transport import load_api
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubeletemulator import KubeletEmulator


@pytest.fixture
def apiserver() -> Iterator[ApiServer]:
    server = ApiServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def kubeconfig(apiserver: ApiServer, tmp_path: Path) -> Path:
    return apiserver.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
def kube_api(kubeconfig: Path) -> client.ApiClient:
    return load_api(str(kubeconfig))


@pytest.fixture
def core_v1(kube_api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(kube_api)


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kl", dir="/tmp"))  # unix socket paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(directory: Path) -> Iterator[KubeletEmulator]:
    emulator = KubeletEmulator(directory)
    emulator.start()
    yield emulator
    emulator.stop()
