"""Shared fixtures: a fresh API server stand-in per test, reached through the official client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client

from gpushare.kube import load_api
from gpushare.sandbox.apiserver import ApiServer


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


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
