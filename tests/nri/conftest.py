"""A real containerd 2.2.9 with NRI on for the tests of tests/nri that need one, and a CRI client on it as
kubelet holds one (its pods, and the pod cgroups the tests gave them under :data:`TEST_CGROUPS`, removed
after each test)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.sandbox import cri_kubelet
from gpushare.sandbox.containerd import Containerd, running_containerd
from gpushare.sandbox.nodecgroups import make_cgroup_root, remove_cgroup_root

#: where the tests' pods have their cgroups (kubelet's would be under /kubepods)
TEST_CGROUPS = "/gpushare-nri-test"


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    """The daemon, and the tests' pod cgroups (:data:`TEST_CGROUPS`) removed once it is gone, as kubelet
    removes its pods' cgroups."""
    made = make_cgroup_root(TEST_CGROUPS.lstrip("/"))
    try:
        with running_containerd(Path(tempfile.mkdtemp(prefix="gs-nri-"))) as daemon:
            yield daemon
    finally:
        remove_cgroup_root(made)


@pytest.fixture
def crictl(containerd: Containerd) -> Iterator[cri_kubelet.CriRuntime]:
    client = cri_kubelet.CriRuntime(containerd.address)
    yield client
    containerd.remove_all_pods()
    client.close()
