"""Whether kubelet is watching a node's device plugin, as the node agent publishes it on the node.

While a kubelet restarts there is a window in which it may admit a pod before the device plugin has
registered with it, and fail the pod for good (``UnexpectedAdmissionError``); the extender places no GPU
pod on a node whose agent says no kubelet is watching.
"""

from __future__ import annotations

from gpushare.contract.errors import AnnotationError, quoted
from gpushare.contract.names import NODE_ANN_KUBELET_WATCHING


def format_watching(watching: bool) -> str:
    return "true" if watching else "false"


def parse_watching(text: str | None, node: str) -> bool:
    """Absent reads as watched (nodes whose agent doesn't publish it); anything but true/false is an
    AnnotationError naming the node and the annotation."""
    if text is None or text == "true":
        return True
    if text == "false":
        return False
    raise AnnotationError(f"node {node} annotation {NODE_ANN_KUBELET_WATCHING}={quoted(text)}: expected true or false")
