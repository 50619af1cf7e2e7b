"""A gang on the real cluster: all members placed, or none.

node-b has 40 + 24 + 24 GiB: eight 10 GiB members fit (4 + 2 + 2), seven once a 10 GiB pod is there."""

from __future__ import annotations

import time

from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.gang import format_gang
from gpushare.contract.names import NODE_ANN_PENDING_BINDS, RESOURCE_MEM
from gpushare.contract.pending import parse_pending_binds

from .conftest import API_POLL, Pods, assert_sees_assigned_cards, pod_manifest

GANG_SIZE = 8
NODE = "node-b"
#: seconds from the room freeing up to every member bound: usually a few (the extender marks the other
#: members once one member's filter holds the plan), but when every member's retry comes before the
#: extender has seen the room free, they wait in kube-scheduler's unschedulable queue for its 60 s flush
BOUND_WITHIN = 75


def gang_holds(core: client.CoreV1Api) -> dict:
    annotations = core.read_node(NODE).metadata.annotations or {}
    return {uid: e for uid, e in parse_pending_binds(annotations.get(NODE_ANN_PENDING_BINDS)).items() if e.gang}


def failed_scheduling(core: client.CoreV1Api, name: str) -> list[str]:
    selector = f"involvedObject.name={name},reason=FailedScheduling"
    return [e.message for e in core.list_namespaced_event("default", field_selector=selector).items]


def test_a_gang_that_does_not_fit_holds_nothing_then_runs_whole_once_room_frees(
    pods: Pods, core: client.CoreV1Api
) -> None:
    blocker = pods.create(pod_manifest(pods.name("blocker"), ({RESOURCE_MEM: 10},), node=NODE))
    pods.wait_running(blocker)
    gang = pods.name("train")
    members = []
    for i in range(GANG_SIZE):
        manifest = pod_manifest(f"{gang}-{i}", ({RESOURCE_MEM: 10},), node=NODE)
        manifest["metadata"]["labels"] = format_gang(gang, GANG_SIZE)
        members.append(pods.create(manifest))
    # a node change sends every unschedulable pod back to the scheduling queue; the members that came
    # before the last one then see all eight present
    core.patch_node(NODE, {"metadata": {"labels": {"gpushare.io/e2e-nudge": gang}}})
    counts = f"gang {gang}: {GANG_SIZE} members present, {GANG_SIZE - 1} can be placed"

    def without_counts() -> dict[str, list[str]]:
        events = {name: failed_scheduling(core, name) for name in members}
        return {name: said for name, said in events.items() if not any(counts in m for m in said)}

    try:
        wait_until(lambda: not without_counts(), 90, f"every member's FailedScheduling event to say {counts!r}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; these said otherwise: {without_counts()}") from None
    assert all(pods.phase(name) == "Pending" and not pods.get(name)["spec"].get("nodeName") for name in members)
    assert gang_holds(core) == {}, "a gang that can't be placed holds nothing"
    small = pods.create(pod_manifest(pods.name("small"), ({RESOURCE_MEM: 4},), node=NODE))
    pods.wait_running(small)
    assert all(pods.phase(name) == "Pending" for name in members)

    core.delete_namespaced_pod(small, "default", grace_period_seconds=0)
    core.delete_namespaced_pod(blocker, "default", grace_period_seconds=0)
    freed = time.monotonic()
    # well within kube-scheduler's 60 s flush of unschedulable pods: the plan's holds mark the members
    wait_until(lambda: all(pods.get(n)["spec"].get("nodeName") for n in members), BOUND_WITHIN, "all bound", API_POLL)
    bound = time.monotonic() - freed
    for name in members:
        pods.wait_running(name)
        assert_sees_assigned_cards(pods, name)
    print(f"gang of {GANG_SIZE}: all bound {bound:.1f} s and running {time.monotonic() - freed:.1f} s after room freed")
    wait_until(lambda: gang_holds(core) == {} or None, 30, "no holds left once all are bound", API_POLL)


def test_a_member_kube_scheduler_can_never_place_keeps_its_gang_unbound(pods: Pods, core: client.CoreV1Api) -> None:
    """The third member also asks for a resource no node has: kube-scheduler's own filter refuses it, so
    it never reaches the extender, and the two that could go must not."""
    gang = pods.name("trio")
    limits = ({RESOURCE_MEM: 10},), ({RESOURCE_MEM: 10},), ({RESOURCE_MEM: 10, "example.com/nothing": 1},)
    members = []
    for i, limit in enumerate(limits):
        manifest = pod_manifest(f"{gang}-{i}", limit, node=NODE)
        manifest["metadata"]["labels"] = format_gang(gang, len(limits))
        members.append(pods.create(manifest))
    # a node change sends every unschedulable pod back to the scheduling queue, once all three exist
    core.patch_node(NODE, {"metadata": {"labels": {"gpushare.io/e2e-nudge": gang}}})
    waiting = f"gang {gang}: 3 members present, 1 not offered any node by kube-scheduler yet (default/{members[2]})"
    wait_until(
        lambda: all(any(waiting in m for m in failed_scheduling(core, name)) for name in members[:2]),
        60,
        f"both placeable members' FailedScheduling event to say {waiting!r}",
        API_POLL,
    )
    assert not any(pods.get(name)["spec"].get("nodeName") for name in members), "no member is bound"
    assert gang_holds(core) == {}
