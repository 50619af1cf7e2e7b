"""A scheduling loop that drives the extender exactly as kube-scheduler does, for the sandbox.

kube-scheduler with a nodeCacheCapable extender sends the full pod and the candidate node names to
``filter``, the survivors to ``prioritize``, then lets the extender ``bind`` the pod to the best node.
This module does the same over HTTP with the same JSON, so the sandbox exercises the real wire format.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.contract.request import pod_key

log = logging.getLogger(__name__)


class ExtenderCallError(RuntimeError):
    """The extender could not be reached or answered something that isn't an extender reply."""


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    pod: str
    node: str | None
    #: why the pod was not bound ("" when it was)
    reason: str = ""


class ExtenderClient:
    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self._url = url.rstrip("/")
        self._timeout = timeout

    def call(self, verb: str, body: Mapping[str, Any]) -> Any:
        data = json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self._url}/{verb}", data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise ExtenderCallError(f"extender {verb}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ExtenderCallError(f"extender {verb}: {exc}") from None


def unschedulable_reason(node_count: int, failed: Mapping[str, str]) -> str:
    """kube-scheduler's wording: ``0/2 nodes are available: <node>: <why>; ...``."""
    details = "; ".join(f"{name}: {why}" for name, why in sorted(failed.items()))
    return f"0/{node_count} nodes are available: {details}" if details else f"0/{node_count} nodes are available"


def best_host(priorities: Sequence[Mapping[str, Any]], candidates: Sequence[str]) -> str:
    """Highest score wins; equal scores go to the first candidate in name order (deterministic)."""
    scores = {p["Host"]: int(p["Score"]) for p in priorities}
    return max(sorted(candidates), key=lambda name: scores.get(name, 0))


def schedule_one(extender: ExtenderClient, pod: Mapping[str, Any], node_names: Sequence[str]) -> ScheduleResult:
    key = pod_key(pod)
    meta = pod.get("metadata") or {}
    filtered = extender.call("filter", {"Pod": pod, "NodeNames": list(node_names)})
    if filtered.get("Error"):
        return ScheduleResult(key, None, f"filter: {filtered['Error']}")
    failed = {**(filtered.get("FailedNodes") or {}), **(filtered.get("FailedAndUnresolvableNodes") or {})}
    candidates = list(filtered.get("NodeNames") or [])
    if not candidates:
        reason = unschedulable_reason(len(node_names), failed)
        log.info("pod %s unschedulable: %s", key, reason)
        return ScheduleResult(key, None, reason)
    priorities = extender.call("prioritize", {"Pod": pod, "NodeNames": candidates})
    node = best_host(priorities, candidates)
    bound = extender.call(
        "bind",
        {"PodName": meta.get("name"), "PodNamespace": meta.get("namespace"), "PodUID": meta.get("uid"), "Node": node},
    )
    if bound.get("Error"):
        log.warning("pod %s: bind to %s failed: %s", key, node, bound["Error"])
        return ScheduleResult(key, None, f"bind to {node}: {bound['Error']}")
    log.info("pod %s scheduled to node %s", key, node)
    return ScheduleResult(key, node)
