"""A GPU pod that waits, on the real kube-scheduler: how often it comes back to the extender while the
cluster changes around it."""

from __future__ import annotations

import time
import urllib.request

from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families
from support.waiting import wait_until

from gpushare.contract.names import RESOURCE_MEM
from gpushare.sandbox.realcluster import RealCluster

from .conftest import API_POLL, POD_TIMEOUT, Pods, pod_manifest

#: an annotation the test rewrites on a node: to kube-scheduler a node change like any other
TICK = "e2e.gpushare.io/tick"
#: node changes made back to back
CHANGES = 100


def filter_calls(cluster: RealCluster) -> float:
    """How many filter calls the default scheduler's extender has answered, from its /metrics."""
    (control,) = [c for c in cluster.controls if c.scheduler_name == "default-scheduler"]
    with urllib.request.urlopen(f"{control.extender_health_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpushare_extender_verb_seconds_count" and sample.labels.get("verb") == "filter":
                return sample.value
    return 0.0


def refused(pods: Pods, name: str) -> bool:
    status = pods.get(name).get("status") or {}
    return any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
               for c in status.get("conditions") or [])  # fmt: skip


def refused_by_extender(core: client.CoreV1Api, name: str) -> bool:
    events = core.list_namespaced_event("default", field_selector=f"involvedObject.name={name}").items
    return any(e.reason == "GPUUnschedulable" for e in events)


def test_a_pod_no_card_can_hold_comes_back_with_back_off_not_on_every_node_change(
    cluster: RealCluster, core: client.CoreV1Api, pods: Pods
) -> None:
    """Any node change sends a pod the extender refused back to kube-scheduler's queue
    (kubernetes#122019); with SchedulerPopFromBackoffQ on, an idle kube-scheduler then retried it at
    once, a filter call per change. With it off, as the sandbox runs kube-scheduler and
    docs/operations.md has operators do, the back-off (1 s, doubling) spaces the retries out, so
    however many changes come, the pod is tried at most once a second after its second try."""
    # node-a's largest card has 80 GiB: kube-scheduler's own plugins let the pod through, the extender never
    name = pods.create(pod_manifest(pods.name("huge"), ({RESOURCE_MEM: 90},), node="node-a"))
    wait_until(lambda: refused(pods, name), POD_TIMEOUT, f"pod {name} refused", API_POLL)
    wait_until(lambda: refused_by_extender(core, name), POD_TIMEOUT, f"the extender's Event on {name}", API_POLL)
    before, started = filter_calls(cluster), time.monotonic()
    try:
        for tick in range(CHANGES):
            core.patch_node("node-a", {"metadata": {"annotations": {TICK: str(tick)}}})
        elapsed = time.monotonic() - started
        calls = filter_calls(cluster) - before
    finally:
        core.patch_node("node-a", {"metadata": {"annotations": {TICK: None}}})
    assert calls <= 2 + elapsed, (
        f"{calls:.0f} filter calls for one waiting pod, {CHANGES} node changes in {elapsed:.1f}s"
    )
    assert pods.phase(name) == "Pending"
