"""Cards fenced by the original extender's unhealthy-GPU ConfigMaps (``unhealthy-gpu-<node>`` in
kube-system): they take no new pods."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gpushare.contract.aliyun import parse_fenced_cards
from gpushare.contract.names import FENCE_CONFIGMAP_KEY, FENCE_CONFIGMAP_PREFIX

log = logging.getLogger(__name__)


class Fences:
    """The fenced card minors of each node. The cache calls it under its lock; it takes none of its own."""

    def __init__(self) -> None:
        self._fenced: dict[str, frozenset[int]] = {}

    def apply(self, kind: str, configmap: Mapping[str, Any]) -> str | None:
        """Take a ConfigMap event; the node it fences cards of, or None for any other ConfigMap."""
        name = (configmap.get("metadata") or {}).get("name", "")
        if not name.startswith(FENCE_CONFIGMAP_PREFIX):
            return None
        node = name[len(FENCE_CONFIGMAP_PREFIX) :]
        fenced = (
            frozenset()
            if kind == "DELETED"
            else parse_fenced_cards((configmap.get("data") or {}).get(FENCE_CONFIGMAP_KEY))
        )
        if fenced != self._fenced.get(node, frozenset()):
            log.info("node %s: cards fenced by ConfigMap %s: %s", node, name, sorted(fenced) or "none")
        self._fenced[node] = fenced
        return node

    def of(self, node: str) -> frozenset[int]:
        return self._fenced.get(node, frozenset())
