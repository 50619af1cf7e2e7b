"""Kubernetes Events: the one recorder every component uses.

It behaves like client-go's recorder in the ways a user sees:

- the caller never waits for the API server: Events go through a bounded queue to one background
  thread, which writes them in the order they were recorded (a full queue drops the Event with a
  log line, as client-go does past 1000 queued Events);
- an Event identical to one already written (same object, source, type, reason and message) is not
  written again: the existing Event's ``count`` goes up and its ``lastTimestamp`` moves, by a merge
  patch, so ``kubectl describe`` shows one line "xN over ..." instead of a screenful. If that Event
  is gone (the API server drops Events after its ``--event-ttl``, one hour by default) a new one is
  created. What was written is remembered in an LRU cache of bounded size, and only for ``window``
  seconds, after which the server has most likely dropped the Event anyway.

client-go also folds *similar* Events (same reason, different messages) into "combined from similar
events" and rate-limits each object's Events; neither is done here.

Components of one process can share a recorder (:meth:`EventRecorder.for_component`): one queue and
one writer for the process, while each Event still names the component it comes from.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from gpushare.kube.errors import KubeError, KubeNotFound
from gpushare.kube.objects import MERGE_PATCH
from gpushare.kube.transport import call
from gpushare.restartable import RestartableThread

log = logging.getLogger(__name__)

#: client-go's sizes: Events queued for the writer, and Events remembered for deduplication
QUEUE_SIZE = 1000
CACHE_SIZE = 4096
#: kube-apiserver's default --event-ttl: an Event older than this is most likely deleted
WINDOW_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class EventKey:
    """What makes two Events the same Event (client-go's key, less the fields we never set)."""

    component: str
    kind: str
    namespace: str
    name: str
    uid: str
    type: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Written:
    """An Event as the API server holds it."""

    name: str
    count: int
    #: time.monotonic() when it was last written
    at: float


class EventLog:
    """The Events written recently, by key: an LRU cache of at most ``capacity`` entries, each
    forgotten ``window`` seconds after it was last written. Not thread-safe (one writer uses it)."""

    def __init__(self, capacity: int = CACHE_SIZE, window: float = WINDOW_SECONDS) -> None:
        if capacity < 1:
            raise ValueError(f"event cache capacity must be at least 1, not {capacity}")
        self._capacity = capacity
        self._window = window
        self._entries: OrderedDict[EventKey, Written] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: EventKey, now: float) -> Written | None:
        """The Event to count ``key`` into, or None when a new one must be created."""
        written = self._entries.get(key)
        if written is None:
            return None
        if now - written.at > self._window:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return written

    def remember(self, key: EventKey, written: Written) -> None:
        self._entries[key] = written
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)


@dataclass(frozen=True, slots=True)
class EventSource:
    """One component's Events, written by a recorder it may share with other components."""

    recorder: EventRecorder
    component: str

    def record(self, obj: Mapping[str, Any], *, reason: str, message: str, type_: str = "Normal") -> None:
        """See :meth:`EventRecorder.record`."""
        self.recorder.record_from(self.component, obj, reason=reason, message=message, type_=type_)


@dataclass(frozen=True, slots=True)
class _Pending:
    """An Event queued for the writer, stamped when it was recorded."""

    key: EventKey
    involved: dict[str, Any]
    timestamp: str


def _timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Records Events about objects for one ``component``; :meth:`close` writes what is queued."""

    def __init__(
        self,
        api: client.ApiClient,
        component: str,
        *,
        queue_size: int = QUEUE_SIZE,
        cache_size: int = CACHE_SIZE,
        window: float = WINDOW_SECONDS,
    ) -> None:
        self._api = api
        self._component = component
        self._log = EventLog(cache_size, window)
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=queue_size)
        self._closed = True
        self._writer = RestartableThread(self._run, f"{component}-events")
        self.start()

    def start(self) -> EventRecorder:
        """Start the writer; after :meth:`close`, or after the writer died, start it again (what is still
        queued is written). A no-op while it runs."""
        if not self._writer.alive():
            self._closed = False
            self._writer.start()
        return self

    def alive(self) -> bool:
        return self._writer.alive()

    def for_component(self, component: str) -> EventSource:
        """Events from ``component``, written by this recorder."""
        return EventSource(self, component)

    def record(self, obj: Mapping[str, Any], *, reason: str, message: str, type_: str = "Normal") -> None:
        """Queue an Event about ``obj`` (a Kubernetes object as a dict). Never blocks, never raises."""
        self.record_from(self._component, obj, reason=reason, message=message, type_=type_)

    def record_from(
        self, component: str, obj: Mapping[str, Any], *, reason: str, message: str, type_: str = "Normal"
    ) -> None:
        """:meth:`record`, with ``component`` as the Event's source."""
        meta = obj.get("metadata") or {}
        kind = obj.get("kind") or "Pod"
        key = EventKey(
            component,
            kind,
            meta.get("namespace") or "",
            meta.get("name") or "",
            meta.get("uid") or "",
            type_,
            reason,
            message,
        )
        involved = {
            "kind": kind,
            "apiVersion": "v1",
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        }
        if self._closed:
            log.warning("event %s on %s/%s dropped: its recorder is closed", reason, key.namespace, key.name)
            return
        try:
            self._queue.put_nowait(_Pending(key, involved, _timestamp()))
        except queue.Full:
            log.warning("event %s on %s/%s dropped: too many events queued", reason, key.namespace, key.name)

    def close(self) -> None:
        """Write what is queued, then stop."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._writer.join()

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                if self._closed:
                    return
                continue  # left by a close() that found the writer dead; the recorder was started again since
            try:
                self._write(pending)
            except KubeError as exc:
                key = pending.key
                log.warning("could not record event %s on %s/%s: %s", key.reason, key.namespace, key.name, exc)
            except Exception:  # the writer must outlive anything the transport throws
                log.exception("recording event %s failed", pending.key.reason)

    def _write(self, pending: _Pending) -> None:
        key = pending.key
        namespace = key.namespace or "default"
        core = client.CoreV1Api(self._api)
        what = f"event {key.reason} for {namespace}/{key.name}"
        seen = self._log.lookup(key, time.monotonic())
        if seen is not None:
            count = seen.count + 1
            patch = {"count": count, "lastTimestamp": pending.timestamp}
            try:
                call(what, core.patch_namespaced_event, seen.name, namespace, patch, _content_type=MERGE_PATCH)
            except KubeNotFound:
                seen = None  # deleted by the server in the meantime: start afresh
            else:
                self._log.remember(key, Written(seen.name, count, time.monotonic()))
                return
        event = {
            "metadata": {"generateName": f"{key.name or 'object'}.", "namespace": namespace},
            "involvedObject": pending.involved,
            "reason": key.reason,
            "message": key.message,
            "type": key.type,
            "source": {"component": key.component},
            "firstTimestamp": pending.timestamp,
            "lastTimestamp": pending.timestamp,
            "count": 1,
        }
        created = call(what, core.create_namespaced_event, namespace, event)
        name = (created.get("metadata") or {}).get("name")
        if name:
            self._log.remember(key, Written(name, 1, time.monotonic()))
