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
from gpushare.extender.wire import reason_histogram, refused_nodes

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


def unschedulable_reason(node_count: int, refused: Mapping[str, str]) -> str:
    """kube-scheduler's FailedScheduling message when no node is left (``FitError.Error``, 1.35 to 1.37):
    ``0/2 nodes are available: 1 <why>, 1 <other why>.``, each distinct reason once with its count."""
    histogram = reason_histogram(refused.values())
    message = f"0/{node_count} nodes are available:"
    return f"{message} {', '.join(histogram)}." if histogram else message


def best_host(priorities: Sequence[Mapping[str, Any]], candidates: Sequence[str]) -> str:
    """Highest score wins; equal scores go to the first candidate in name order (deterministic)."""
    scores = {p["Host"]: int(p["Score"]) for p in priorities}
    return max(sorted(candidates), key=lambda name: scores.get(name, 0))


def filter_outcome(reply: Mapping[str, Any], node_names: Sequence[str]) -> tuple[list[str], str]:
    """The nodes a filter reply lets through, or none and the pod's FailedScheduling message, as
    kube-scheduler makes them (``HTTPExtender.Filter`` and ``findNodesThatPassExtenders``): a non-empty
    ``Error`` fails the call and is the whole message; a node in ``FailedAndUnresolvableNodes`` has
    that reason even when it is also in ``FailedNodes``; a node refused in neither map adds no reason;
    a passing node that was not offered fails the call."""
    if reply.get("Error"):
        return [], str(reply["Error"])
    passing = list(reply.get("NodeNames") or [])
    offered = set(node_names)
    for name in passing:
        if name not in offered:
            return [], f"extender claims a filtered node {name!r} which is not found in the input node list"
    if passing:
        return passing, ""
    refused = refused_nodes(reply.get("FailedNodes") or {}, reply.get("FailedAndUnresolvableNodes") or {})
    return [], unschedulable_reason(len(node_names), refused)


def schedule_one(extender: ExtenderClient, pod: Mapping[str, Any], node_names: Sequence[str]) -> ScheduleResult:
    key = pod_key(pod)
    meta = pod.get("metadata") or {}
    filtered = extender.call("filter", {"Pod": pod, "NodeNames": list(node_names)})
    candidates, reason = filter_outcome(filtered, node_names)
    if not candidates:
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
