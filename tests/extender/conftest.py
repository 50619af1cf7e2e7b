"""The clusters the extender's tests run against (tests/support/extender.py), started and stopped
for each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client
from support.extender import ADMITTING_NODES, AdmittingCluster, Cluster


@pytest.fixture
def cluster(kube_api: client.ApiClient, core_v1: client.CoreV1Api) -> Iterator[Cluster]:
    """``NODES`` and a binpack extender: a small pod goes to the fullest card that fits."""
    cl = Cluster(kube_api, core_v1)
    yield cl
    cl.extender.stop()


@pytest.fixture
def admitting_cluster(
    kube_api: client.ApiClient, core_v1: client.CoreV1Api, kubeconfig: Path, tmp_path: Path
) -> Iterator[Callable[..., AdmittingCluster]]:
    """Starts an ``AdmittingCluster`` of the given nodes (``ADMITTING_NODES`` by default); each one
    started is stopped after the test."""
    started: list[AdmittingCluster] = []

    def start(nodes: dict[str, str] = ADMITTING_NODES) -> AdmittingCluster:
        # unix socket paths must stay short, so the device-plugin directories live right under tmp_path
        started.append(AdmittingCluster(kube_api, core_v1, kubeconfig, tmp_path, nodes))
        return started[-1]

    yield start
    for cl in started:
        cl.stop()
