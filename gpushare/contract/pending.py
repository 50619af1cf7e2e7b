"""The node annotation in which the extender's bind records binds whose binding may not exist yet."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from gpushare.contract.errors import AnnotationError
from gpushare.contract.names import NODE_ANN_PENDING_BINDS


@dataclass(frozen=True, slots=True)
class PendingBind:
    """A bind recorded on its node before its binding: the pod, its units per card UUID, and when
    (seconds since the epoch)."""

    pod: str
    held: Mapping[str, int]
    at: float


def parse_pending_binds(text: str | None, node: str = "?") -> dict[str, PendingBind]:
    """The node's pending binds by pod UID (JSON uid -> {pod, held: {card uuid: units}, at})."""
    if not text:
        return {}
    where = f"node {node} annotation {NODE_ANN_PENDING_BINDS}"
    try:
        raw = json.loads(text)
        return {
            uid: PendingBind(str(e["pod"]), {str(k): int(v) for k, v in e["held"].items()}, float(e["at"]))
            for uid, e in raw.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError):
        raise AnnotationError(f"{where}: expected an object of pod uid -> {{pod, held, at}}") from None


def format_pending_binds(pending: Mapping[str, PendingBind]) -> str:
    return json.dumps(
        {
            uid: {"pod": p.pod, "held": dict(sorted(p.held.items())), "at": round(p.at, 3)}
            for uid, p in sorted(pending.items())
        },
        separators=(",", ":"),
    )
