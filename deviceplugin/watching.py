"""Publishes on the node whether a kubelet is watching the device plugin (``gpushare.io/kubelet-watching``).

When kubelet goes, its ListAndWatch streams end at once; from then until a kubelet watches again the
extender places no GPU pod on the node (:func:`gpushare.holdings.node.kubelet_refusal`). Without that, a pod bound
while kubelet restarts can be admitted by the new kubelet before the plugin has registered with it, and
fail for good with ``UnexpectedAdmissionError``. A thread of its own writes the latest state, so a
stream's end never waits on the API server; a failed write is retried with back-off while it is still
the latest state.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from gpushare.contract.kubeletwatch import format_watching
from gpushare.contract.names import NODE_ANN_KUBELET_WATCHING
from gpushare.kube.errors import KubeError
from gpushare.kube.objects import patch_node
from gpushare.kube.retry import DEFAULT_BACKOFF

log = logging.getLogger(__name__)


class WatchingPublisher:
    """Call it with True when a kubelet opens a ListAndWatch stream, False when one ends."""

    def __init__(self, api: Any, node: str) -> None:
        self._api = api
        self._node = node
        self._changed = threading.Condition()
        self._latest: bool | None = None
        self._written: bool | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kubelet-watching", daemon=True)
        self._thread.start()

    def __call__(self, watching: bool) -> None:
        with self._changed:
            self._latest = watching
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        delays = DEFAULT_BACKOFF.delays()
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or self._latest != self._written)
                if self._closed:
                    return
                watching = self._latest
            assert watching is not None
            try:
                patch_node(self._api, self._node, {"metadata": {"annotations": {
                    NODE_ANN_KUBELET_WATCHING: format_watching(watching)}}})  # fmt: skip
            except KubeError as exc:
                delay = next(delays)
                log.warning("node %s: recording that kubelet %s the device plugin failed (%s); retrying in %.1fs",
                            self._node, "watches" if watching else "stopped watching", exc, delay)  # fmt: skip
                with self._changed:
                    self._changed.wait_for(lambda w=watching: self._closed or self._latest != w, delay)
                continue
            delays = DEFAULT_BACKOFF.delays()
            self._written = watching
            if watching:
                log.info("node %s: kubelet is watching the device plugin; GPU pods may be placed here", self._node)
            else:
                log.warning("node %s: kubelet stopped watching the device plugin (restarting?); no GPU pod is "
                            "placed here until one watches again", self._node)  # fmt: skip
