"""Shared fixtures: a fresh API server stand-in per test, reached through the official client, and a
kubelet emulator in a private device-plugins directory."""

from __future__ import annotations

import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpushare.kube.transport import load_api
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubelet import KubeletEmulator
from gpushare.sandbox.launch import ClusterError, wait_for


def wait_until(
    predicate: Callable[[], object], timeout: float = 5.0, what: str = "condition", interval: float = 0.01
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    try:
        return wait_for(predicate, timeout, what, interval)
    except ClusterError as exc:
        raise AssertionError(str(exc)) from None


def host_scores(reply: list[dict[str, Any]], names: Sequence[str]) -> dict[str, int]:
    """A prioritize reply (a HostPriorityList) as kube-scheduler counts it: every node of ``names``, a
    node the reply leaves out scoring 0; each entry a node asked about, once, with a score of 0..10."""
    hosts = [entry["Host"] for entry in reply]
    assert len(set(hosts)) == len(hosts) and set(hosts) <= set(names), hosts
    assert all(set(entry) == {"Host", "Score"} and isinstance(entry["Score"], int) for entry in reply)
    assert all(1 <= entry["Score"] <= 10 for entry in reply), reply
    return dict.fromkeys(names, 0) | {entry["Host"]: entry["Score"] for entry in reply}


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


def readiness(url: str) -> int:
    """The HTTP status of ``url``/readyz."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


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
