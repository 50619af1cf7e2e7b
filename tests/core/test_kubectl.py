"""The real kubectl against the API server stand-in: discovery, listing, events by the object they are
about, and ``kubectl describe pod``, which reads those events."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from kubernetes import client
from podfactory import container, gpu_pod

from gpushare.kube.events import EventRecorder
from gpushare.sandbox import binaries
from gpushare.sandbox.binaries import KUBE_VERSION

KUBECTL = str(binaries.built("kubectl")) if binaries.missing(("kubectl",)) is None else shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason=str(binaries.missing(("kubectl",))))


@pytest.fixture
def kubectl(kubeconfig: Path, tmp_path: Path):
    def run(*args: str) -> str:
        done = subprocess.run(
            [str(KUBECTL), "--kubeconfig", str(kubeconfig), "--cache-dir", str(tmp_path / "cache"), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"kubectl {' '.join(args)} failed: {done.stderr}"
        return done.stdout

    return run


def pod(name: str, node: str) -> dict:
    return gpu_pod(name, [container("c")], node=node, namespace=None)


def test_discovery_and_listing(kubectl, core_v1: client.CoreV1Api) -> None:
    core_v1.create_node({"metadata": {"name": "n1", "labels": {"gpu": "yes"}}})
    core_v1.create_namespaced_pod("default", pod("p", "n1"))
    core_v1.create_namespaced_pod("other", pod("q", "n1"))
    # the stand-in answers as the Kubernetes release the real-cluster tests run
    assert json.loads(kubectl("version", "-o", "json"))["serverVersion"]["gitVersion"].startswith(KUBE_VERSION)
    assert kubectl("get", "pods", "-o", "name").split() == ["pod/p"]
    assert sorted(kubectl("get", "po", "--all-namespaces", "-o", "name").split()) == ["pod/p", "pod/q"]
    nodes = json.loads(kubectl("get", "nodes", "-o", "json"))["items"]
    assert [(n["metadata"]["name"], n["metadata"]["labels"]) for n in nodes] == [("n1", {"gpu": "yes"})]
    assert kubectl("get", "no", "-l", "gpu=no", "-o", "name") == ""


def test_events_by_involved_object_and_describe_pod(kubectl, kube_api: client.ApiClient) -> None:
    core = client.CoreV1Api(kube_api)
    recorder = EventRecorder(kube_api, "test")
    for name, times in (("p", 3), ("q", 1)):
        created = kube_api.sanitize_for_serialization(core.create_namespaced_pod("default", pod(name, "n1")))
        for _ in range(times):
            recorder.record(created, reason="GPUAllocationRefused", message=f"no card for {name}", type_="Warning")
    recorder.close()
    listed = json.loads(kubectl("get", "events", "--field-selector", "involvedObject.name=p", "-o", "json"))
    assert [e["message"] for e in listed["items"]] == ["no card for p"]
    described = kubectl("describe", "pod", "p")
    assert "Node:         n1" in described
    events = described[described.index("Events:") :]
    assert "GPUAllocationRefused" in events and "no card for p" in events and "no card for q" not in events
    assert "(x3 over" in events  # the three identical Events are one, counted
