"""Numbers too large to count (``cpu: 1e30``, which the API server accepts): the pod or node that carries
one is refused or flagged alone, naming it, and every verb goes on answering for everyone else."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gpushare.extender.wiring import RunningExtender, start_extender
from podfactory import container, gpu_pod
from support.extender import NODES, Cluster
from support.waiting import wait_until

from gpushare.contract.names import RESOURCE_MEM

HUGE_CPU = "pod default/huge container 'main' resources.requests.cpu: '1e30' is more than the 9007199254740992"


def huge_pod(name: str = "huge", gib: int = 0, node: str | None = None, **requests: str) -> dict[str, Any]:
    pod = gpu_pod(name, [container("main", gib)], node=node)
    pod["spec"]["containers"][0]["resources"]["requests"] = requests or {"cpu": "1e30"}
    return pod


def bound(cluster: Cluster, pod: dict[str, Any]) -> None:
    """Create ``pod`` bound to its node, as anyone may, and wait for the extender's cache to have it."""
    cluster.core.create_namespaced_pod("default", pod)
    name = pod["metadata"]["name"]
    wait_until(lambda: cluster.extender.cache.pod("default", name), what=f"pod {name} in the cache")


def scores(cluster: Cluster, verb: str, pod: dict[str, Any]) -> list[dict[str, Any]]:
    return cluster.post(verb, {"Pod": pod, "NodeNames": list(NODES)})


@pytest.fixture
def fgdfit(cluster: Cluster) -> Iterator[Any]:
    """Starts another extender, under the CPU-and-memory weighing policy, beside ``cluster``."""
    started: list[RunningExtender] = []

    def start() -> Cluster:
        started.append(start_extender(cluster.api, 0, "fgdfit", host="127.0.0.1"))
        assert started[-1].cache.wait_synced(5)
        return Cluster.beside(cluster, started[-1])

    yield start
    for extender in started:
        extender.stop()


def test_a_bound_pod_asking_for_cpu_1e30_takes_no_verb_down(cluster: Cluster, fgdfit: Any) -> None:
    bound(cluster, huge_pod("huge", node="n1"))
    bound(cluster, huge_pod("huge-gpu", gib=4, node="n1", cpu="1e30", memory="1e40"))
    pod = cluster.pod(gpu_pod("p", [container("main", 4)], node=None))
    assert cluster.filter(pod)["NodeNames"] == ["n1", "n2"]
    assert scores(cluster, "prioritize", pod)
    # an extender started while the pods exist learns its workload from them, and weighs CPU and memory
    other = fgdfit()
    wait_until(lambda: other.extender.cache.pod("default", "huge-gpu"), what="the pods in the new extender")
    assert other.filter(pod)["NodeNames"] == ["n1", "n2"]
    assert scores(other, "prioritize", pod)
    plain = cluster.pod(gpu_pod("plain", [container("main")], node=None))
    assert scores(other, "prioritize-host", plain)
    assert other.bind(pod, "n1")["Error"] == ""


@pytest.mark.parametrize("gib", [0, 4], ids=["no-gpu", "gpu"])
def test_a_pod_asking_for_cpu_1e30_is_refused_alone_naming_it(cluster: Cluster, gib: int) -> None:
    huge = cluster.pod(huge_pod(gib=gib))
    refused = cluster.filter(huge)
    assert refused["NodeNames"] == [] and set(refused["FailedAndUnresolvableNodes"]) == set(NODES), refused
    assert all(r.startswith(HUGE_CPU) for r in refused["FailedAndUnresolvableNodes"].values()), refused
    assert scores(cluster, "prioritize", huge) == [] and scores(cluster, "prioritize-host", huge) == []
    if gib:
        assert cluster.bind(huge, "n1")["Error"].startswith(f"bind to node n1: {HUGE_CPU}")
    pod = cluster.pod(gpu_pod("p", [container("main", 4)], node=None))
    assert cluster.filter(pod)["NodeNames"] == ["n1", "n2"]


def test_a_gpu_mem_request_too_large_to_count_is_refused_naming_it(cluster: Cluster) -> None:
    spec = gpu_pod("huge", [container("main", 1)], node=None)
    spec["spec"]["containers"][0]["resources"]["limits"][RESOURCE_MEM] = "9" * 30
    reason = cluster.filter(cluster.pod(spec))["FailedAndUnresolvableNodes"]["n1"]
    assert reason == f"pod default/huge container main {RESOURCE_MEM}: '{'9' * 30}' is more than the 4294967296 allowed"
    bound(
        cluster,
        {**spec, "metadata": {**spec["metadata"], "name": "huge-bound"}, "spec": {**spec["spec"], "nodeName": "n1"}},
    )
    pod = cluster.pod(gpu_pod("p", [container("main", 4)], node=None))
    assert cluster.filter(pod)["NodeNames"] == ["n1", "n2"]
    assert scores(cluster, "prioritize", pod)


def test_a_node_whose_allocatable_cpu_is_1e30_takes_no_verb_down(cluster: Cluster, fgdfit: Any) -> None:
    cluster.core.patch_node_status("n2", {"status": {"allocatable": {"cpu": "1e30", "memory": "64Gi", "pods": "1e30"}}})
    wait_until(
        lambda: (cluster.extender.cache.nodes.get("n2").get("status") or {}).get("allocatable"),
        what="n2's allocatable in the cache",
    )
    other = fgdfit()
    pod = cluster.pod(gpu_pod("p", [container("main", 4)], node=None))
    for extender in (cluster, other):
        assert extender.filter(pod)["NodeNames"] == ["n1", "n2"]
        assert scores(extender, "prioritize", pod)
    assert scores(other, "prioritize-host", cluster.pod(gpu_pod("plain", [container("main")], node=None))) is not None
