"""What the components of one node's process share of the API server: one LIST+WATCH of the node's
pods and one Event writer, instead of one of each per component (on 1,000 nodes, 1,000 pod watches
rather than 2,000).

It outlives the components that use it. ``gpushare node`` supervises it as a component of its own,
started first and stopped last; a component restarted meanwhile finds the same cache, still synced.
Should its own threads die, :meth:`NodeApi.start` starts them again in place, so the components keep
the objects they hold; until then ``/readyz`` fails, and the cache says it is not connected, so nothing
decides on what it held.
"""

from __future__ import annotations

from typing import Any

from gpushare.kube.events import EventRecorder
from gpushare.kube.watch import WatchCache, node_pod_cache

#: names the shared writer's thread; each Event names the component it comes from
RECORDER_NAME = "gpushare-node"


class NodeApi:
    """The API client, the node's pod cache (unless ``watch_pods`` is off) and the Event recorder."""

    def __init__(self, api: Any, node_name: str, *, watch_pods: bool = True) -> None:
        self.api = api
        self.node_name = node_name
        self.pods: WatchCache | None = node_pod_cache(api, node_name) if watch_pods else None
        self.events = EventRecorder(api, RECORDER_NAME)

    def start(self) -> NodeApi:
        """Start the watch; after :meth:`stop`, or a thread's death, start what is not running again."""
        if self.pods is not None:
            self.pods.start()
        self.events.start()
        return self

    def alive(self) -> bool:
        return self.events.alive() and (self.pods is None or self.pods.alive())

    def ready(self) -> bool:
        """The node's pods have been listed at least once."""
        return self.pods is None or self.pods.synced

    def stop(self) -> None:
        """Stop the watch, and write the Events still queued."""
        if self.pods is not None:
            self.pods.stop()
        self.events.close()
