"""A pod's gang: the labels that make its members be bound all together or not at all."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.names import LABEL_GANG, LABEL_GANG_MIN
from gpushare.contract.request import pod_key


class GangError(ContractError):
    """A pod's gang labels can't be read (one without the other, or a bad minimum)."""


@dataclass(frozen=True, slots=True)
class Gang:
    """A gang is named within its namespace; ``minimum`` members must be placeable at once."""

    namespace: str
    name: str
    minimum: int

    @property
    def key(self) -> str:
        """How holds on a node name the gang: ``namespace/name``."""
        return f"{self.namespace}/{self.name}"


def parse_gang(pod: Mapping[str, Any]) -> Gang | None:
    """The pod's gang, or None when it has no gang label; raises GangError naming the pod and label."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    name, minimum = labels.get(LABEL_GANG), labels.get(LABEL_GANG_MIN)
    if name is None and minimum is None:
        return None
    where = f"pod {pod_key(pod)}"
    if not name:
        raise GangError(f"{where}: label {LABEL_GANG_MIN} needs label {LABEL_GANG} naming the gang")
    if minimum is None:
        raise GangError(f"{where}: label {LABEL_GANG}={quoted(name)} needs label {LABEL_GANG_MIN} (members needed)")
    try:
        count = int(minimum)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or str(count) != str(minimum).strip():
        raise GangError(f"{where}: label {LABEL_GANG_MIN}={quoted(minimum)} is not a whole number >= 1")
    return Gang(str(meta.get("namespace") or "default"), str(name), count)


def format_gang(name: str, minimum: int) -> dict[str, str]:
    """The labels that put a pod into gang ``name`` of at least ``minimum`` members."""
    if not name or minimum < 1:
        raise GangError(f"gang {quoted(name)}: needs a name and a minimum >= 1, got {minimum}")
    return {LABEL_GANG: name, LABEL_GANG_MIN: str(minimum)}
