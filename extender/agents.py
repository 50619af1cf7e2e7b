"""Whether a node's gpushare node agent is up, as its DaemonSet pod says, for nodes where it runs as one.

The node agent is the node's device plugin. While it is away (killed, OOM-killed, being replaced by a
rolling update) kubelet has no healthy ``aliyun.com`` device to allocate, and refuses a GPU pod bound to
the node for good (``UnexpectedAdmissionError: Allocate failed due to no healthy devices present``,
kubelet's devicemanager), where the pod should wait. kubelet reports the resources gone only with its
next node status (up to ``nodeStatusUpdateFrequency``, 10 s), which an agent restarted in a few seconds
never reaches; the agent's pod turns not Ready as soon as kubelet sees its container end, and Ready again
once its readiness probe passes (every component serving, the device plugin registered). So the extender
places no GPU pod on a node whose agent pod it has seen, while none of that node's agent pods is Ready and
live. Only pods in the namespace gpushare is installed in count (``--node-agent-namespace``): a tenant
can't make a node look down, or up, with a pod of its own. A node whose agent never ran as a pod (the
agent run as a host service, the sandbox) has no opinion here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpushare.contract.names import NODE_AGENT_LABEL


def is_node_agent(pod: Mapping[str, Any], namespace: str) -> bool:
    """A pod of the node agent DaemonSet in ``namespace``."""
    meta = pod.get("metadata") or {}
    key, value = NODE_AGENT_LABEL
    return bool(namespace) and meta.get("namespace") == namespace and (meta.get("labels") or {}).get(key) == value


def agent_up(pod: Mapping[str, Any]) -> bool:
    """The agent pod is Ready and not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def agent_refusal(node: str) -> str:
    return (
        f"node {node}: its gpushare node agent (the device plugin) is not Ready (restarting or being "
        "upgraded); GPU pods wait until it is"
    )
