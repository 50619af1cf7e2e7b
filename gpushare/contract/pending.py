"""The extender's ledger: the node annotation in which the extender's bind records every pod it binds
to the node, with what the pod holds there, from before the binding until the pod is gone or finished;
and the gang holds: cards set aside for a gang member that isn't bound yet (an entry with a ``gang``).

Only the extender writes it (tenants can't write Node objects), so it is the record of a pod's cards
that its owner can't rewrite; see :mod:`gpushare.holdings.pod` for how it outranks pod annotations.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from gpushare.contract import jsondepth
from gpushare.contract.errors import AnnotationError
from gpushare.contract.names import NODE_ANN_PENDING_BINDS
from gpushare.contract.units import UNITS_LIMIT

#: how long a bind counts on its node while its pod is still unbound: far longer than a binding call may
#: take (its timeout is 10 s); a bind whose binding failed is forgotten after it
PENDING_SECONDS = 60.0
#: how long a gang hold counts while its member is unbound; the gang's filter renews it while the plan
#: still fits, so only a gang nobody schedules any more loses its cards this way
HOLD_SECONDS = 180.0
#: the most the ledger annotation may take: all of a node's annotations share 256 KiB, and 110 pods'
#: entries take about 19 KB, so this leaves room for far more pods and the node's other annotations
LEDGER_BYTES = 128 * 1024
#: the most the ledger may take with gang holds written into it: the rest stays free for binds
HOLD_BYTES = 64 * 1024


class LedgerError(AnnotationError):
    """The node's ledger annotation can't be read."""


@dataclass(frozen=True, slots=True)
class PendingBind:
    """One pod's ledger entry: the pod, its units per card UUID, and when it was bound (seconds since
    the epoch)."""

    pod: str
    held: Mapping[str, int]
    at: float
    #: the gang (``namespace/name``) whose member the cards are held for, until it is bound
    gang: str = ""

    def expires(self) -> float:
        """When the entry stops counting if its pod is still unbound by then."""
        return self.at + (HOLD_SECONDS if self.gang else PENDING_SECONDS)


Ledger = Mapping[str, PendingBind]


def parse_pending_binds(text: str | None, node: str = "?") -> dict[str, PendingBind]:
    """The node's ledger by pod UID (JSON uid -> {pod, held: {card uuid: units}, at[, gang]})."""
    if not text:
        return {}
    where = f"node {node} annotation {NODE_ANN_PENDING_BINDS}"
    try:
        raw = jsondepth.loads(text)
        ledger = {
            uid: PendingBind(
                str(e["pod"]), {str(k): int(v) for k, v in e["held"].items()}, float(e["at"]), str(e.get("gang") or "")
            )
            for uid, e in raw.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError):
        raise LedgerError(f"{where}: expected an object of pod uid -> {{pod, held, at}}") from None
    if any(units <= 0 for entry in ledger.values() for units in entry.held.values()):
        raise LedgerError(f"{where}: a pod holds a non-positive number of units on a card")
    if any(units > UNITS_LIMIT for entry in ledger.values() for units in entry.held.values()):
        raise LedgerError(f"{where}: a pod holds more than the {UNITS_LIMIT} units allowed on a card")
    return ledger


def format_pending_binds(pending: Ledger) -> str:
    return json.dumps(
        {
            uid: {"pod": p.pod, "held": dict(sorted(p.held.items())), "at": round(p.at, 3)}
            | ({"gang": p.gang} if p.gang else {})
            for uid, p in sorted(pending.items())
        },
        separators=(",", ":"),
    )
