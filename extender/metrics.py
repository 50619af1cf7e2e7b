"""Prometheus metrics of the extender."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from gpushare.extender.cache import ClusterCache
    from gpushare.extender.nodeview import NodeView

VERB_LATENCY = Histogram(
    "gpushare_extender_verb_seconds",
    "Time to answer one extender call",
    ["verb"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
)
BIND_BATCH = Histogram(
    "gpushare_extender_bind_batch_size",
    "Binds onto one node recorded by one write of the node (those that waited for it together)",
    buckets=(1, 2, 4, 8, 16),
)
BIND_FAILURES = Counter("gpushare_extender_bind_failures_total", "Binds that failed", ["reason"])
#: the per-card gauges, (name, help), each with the labels node, card and model; see CardGauges
CARD_GAUGES = (
    ("gpushare_extender_card_allocated_units", "Units of the card held, as the extender sees it"),
    ("gpushare_extender_card_total_units", "Units of the card"),
)


def _label(value: str) -> str:
    """A label value as the text format quotes it: backslash, double quote and line feed escaped
    (https://prometheus.io/docs/instrumenting/exposition_formats/#text-format-details)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _card_lines(view: NodeView) -> tuple[bytes, bytes]:
    """The node's samples of each gauge of CARD_GAUGES, in the text exposition format."""
    allocated, total = [], []
    for card in view.cards:
        labels = f'{{card="{card.index}",model="{_label(card.model)}",node="{_label(view.name)}"}}'
        allocated.append(f"{CARD_GAUGES[0][0]}{labels} {floatToGoString(card.used)}\n")
        total.append(f"{CARD_GAUGES[1][0]}{labels} {floatToGoString(card.capacity)}\n")
    return "".join(allocated).encode(), "".join(total).encode()


class CardGauges:
    """The per-card gauges of one extender's cache, as exposition text kept per node.

    A node's lines are written again only once something on it changed (the cache's change listener
    marks it, and the next scrape writes them); a scrape joins the text of every node. For 2,000 nodes x
    8 cards (3 MB) that is 5 ms, 85 ms when every node changed; setting prometheus_client's Gauges for
    every card and rendering them, as each scrape did before, took 0.7 s and 1 s of the GIL the verbs
    need. docs/operations.md, Metrics, has the figures.
    """

    def __init__(self, cache: ClusterCache) -> None:
        self._cache = cache
        #: guards ``_changed``, which the cache's threads add to
        self._lock = threading.Lock()
        self._changed: set[str] = set()
        #: one render at a time; guards ``_lines``
        self._render_lock = threading.Lock()
        #: node -> its lines of each gauge; nodes whose cards can't be read have none
        self._lines: dict[str, tuple[bytes, bytes]] = {}
        cache.add_change_listener(self._note)

    def _note(self, node: str) -> None:
        """Under the cache's lock: mark only, the lines are written at the next scrape."""
        with self._lock:
            self._changed.add(node)

    def exposition(self) -> bytes:
        """Both gauges in the text format, every node's lines current."""
        with self._render_lock:
            with self._lock:
                changed, self._changed = self._changed, set()
            for node in changed:
                view = self._cache.view(node)
                if view is None:  # gone, or its cards can't be read
                    self._lines.pop(node, None)
                else:
                    self._lines[node] = _card_lines(view)
            parts = []
            for i, (name, documentation) in enumerate(CARD_GAUGES):
                parts.append(f"# HELP {name} {documentation}\n# TYPE {name} gauge\n".encode())
                parts.extend(lines[i] for lines in self._lines.values())
            return b"".join(parts)
