"""A real containerd 2.2.9 with NRI on for the tests of tests/nri that need one, and a CRI client on it as
kubelet holds one (its pods removed after each test)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.sandbox import cri_kubelet
from gpushare.sandbox.containerd import Containerd, running_containerd


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    with running_containerd(Path(tempfile.mkdtemp(prefix="gs-nri-"))) as daemon:
        yield daemon


@pytest.fixture
def crictl(containerd: Containerd) -> Iterator[cri_kubelet.CriRuntime]:
    client = cri_kubelet.CriRuntime(containerd.address)
    yield client
    containerd.remove_all_pods()
    client.close()
