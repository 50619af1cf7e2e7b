"""Which waiting pods a bound pod's end marks for a retry (extender/roomwaiters.py): the marking without an
API server, and which refusals make a pod wait, through a running extender."""

from __future__ import annotations

from typing import Any

import pytest
from gpushare.extender import roomwaiters
from gpushare.extender.roomwaiters import RoomWaiters, Waiter
from podfactory import container, gpu_pod
from support.extender import Cluster
from support.waiting import wait_until

from gpushare.contract.names import ANN_RETRY


class Watch:
    """Stands in for one of the extender's watches: the waiters' listener is called as the cache calls it."""

    def add_listener(self, listener: Any) -> None:
        self.listener = listener


class Cache:
    """The extender's cache as the waiters see it: its pod and node watches, and each node's problem."""

    def __init__(self) -> None:
        self.pods, self.nodes = Watch(), Watch()
        self.problems: dict[str, str] = {}

    def problem(self, node: str) -> str | None:
        return self.problems.get(node)


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    done: list[tuple[str, str, str]] = []

    def patch(_api: Any, namespace: str, name: str, annotations: dict[str, str]) -> None:
        done.extend((namespace, name, key) for key in annotations)

    monkeypatch.setattr(roomwaiters, "patch_pod_annotations", patch)
    return done


@pytest.fixture
def cache() -> Cache:
    return Cache()


@pytest.fixture
def waiters(cache: Cache, marked: list) -> RoomWaiters:
    """Waiters over ``cache`` whose marks land in ``marked``."""
    return RoomWaiters(None, cache)


def bound(name: str, node: str, phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"}, "spec": {"nodeName": node},
            "status": {"phase": phase}}  # fmt: skip


def waiter(name: str, nodes: set[str] | None) -> Waiter:
    return Waiter("default", name, "gpushare.io/retry", None if nodes is None else frozenset(nodes))


def settle(waiters: RoomWaiters) -> None:
    """Stop the marking thread once it has done everything queued before."""
    waiters.close()


def test_an_end_marks_the_pods_refused_on_its_node_once(marked: list, cache: Cache, waiters: RoomWaiters) -> None:
    pods = cache.pods
    waiters.wait("uid-a", waiter("a", {"n1"}), waiters.seen())
    waiters.wait("uid-b", waiter("b", {"n2"}), waiters.seen())
    waiters.wait("gang-g", waiter("g0", None), waiters.seen())
    pods.listener("MODIFIED", bound("still-running", "n1"))  # holds its cards: frees nothing
    pods.listener("DELETED", bound("done", "n1"))
    pods.listener("MODIFIED", bound("finished", "n1", phase="Succeeded"))  # a second end: no one left to mark
    settle(waiters)
    assert marked == [("default", "a", "gpushare.io/retry"), ("default", "g0", "gpushare.io/retry")]


def test_a_refusal_that_may_have_missed_an_end_is_marked_at_once(
    marked: list, cache: Cache, waiters: RoomWaiters
) -> None:
    pods = cache.pods
    seen = waiters.seen()  # the filter begins
    pods.listener("DELETED", bound("done", "n1"))  # an end before its refusal is remembered
    waiters.wait("uid-a", waiter("a", {"n2"}), seen)
    settle(waiters)
    assert marked == [("default", "a", "gpushare.io/retry")]


def test_a_pod_bound_deleted_or_admitted_waits_no_more(marked: list, cache: Cache, waiters: RoomWaiters) -> None:
    pods = cache.pods
    waiters.wait("uid-a", waiter("a", {"n1"}), waiters.seen())
    waiters.wait("uid-b", waiter("b", {"n1"}), waiters.seen())
    pods.listener("MODIFIED", bound("a", "n2"))  # a was bound elsewhere
    waiters.forget("uid-b")  # b's next filter passed
    pods.listener("DELETED", bound("done", "n1"))
    settle(waiters)
    assert marked == []


def test_a_node_that_can_take_gpu_pods_again_marks_the_pods_refused_there(
    marked: list, cache: Cache, waiters: RoomWaiters
) -> None:
    node = {"metadata": {"name": "n1"}}
    cache.problems["n1"] = "node n1: no kubelet is watching its gpushare device plugin"
    cache.nodes.listener("MODIFIED", node)
    waiters.wait("uid-a", waiter("a", {"n1"}), waiters.seen())
    waiters.wait("uid-b", waiter("b", {"n2"}), waiters.seen())
    cache.nodes.listener("MODIFIED", node)  # still troubled: nothing to retry for
    del cache.problems["n1"]
    cache.nodes.listener("MODIFIED", node)
    cache.nodes.listener("MODIFIED", node)  # fine before and after: no news
    settle(waiters)
    assert marked == [("default", "a", "gpushare.io/retry")]


def retry_marks(cluster: Cluster, *names: str) -> dict[str, str | None]:
    pods = {name: cluster.core.read_namespaced_pod(name, "default") for name in names}
    return {name: (pod.metadata.annotations or {}).get(ANN_RETRY) for name, pod in pods.items()}


def test_a_pod_no_card_of_a_node_could_hold_does_not_wait_for_room_there(cluster: Cluster) -> None:
    """Room freed on n2 (one 24 GiB A10) can hold 10 GiB but never 30 GiB: only the first pod is worth a
    retry there. The second is refused as unresolvable (no preemption helps either) and not marked."""
    blocker = cluster.pod(gpu_pod("blocker", [container("main", 20)], node=None))
    assert cluster.bind(blocker, "n2")["Error"] == ""  # the A10 has 4 GiB left
    huge = cluster.pod(gpu_pod("huge", [container("main", 30)], node=None))
    waiting = cluster.pod(gpu_pod("waiting", [container("main", 10)], node=None))
    # refused first: its mark, were it made, would come before the other's
    refused = cluster.filter(huge, ["n2"])
    assert refused["NodeNames"] == [] and set(refused["FailedAndUnresolvableNodes"]) == {"n2"}
    refused = cluster.filter(waiting, ["n2"])
    assert "no single card has 10 GiB free" in refused["FailedNodes"]["n2"]
    assert refused["FailedAndUnresolvableNodes"] == {}
    cluster.core.delete_namespaced_pod("blocker", "default", grace_period_seconds=0)
    wait_until(lambda: retry_marks(cluster, "waiting")["waiting"], what="the pod that fits marked for a retry")
    assert retry_marks(cluster, "huge") == {"huge": None}
