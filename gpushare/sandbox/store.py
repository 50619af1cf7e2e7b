"""The API stand-in's object store: versioned objects, preconditions and a watchable event history."""

from __future__ import annotations

import copy
import itertools
import threading
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpushare.sandbox.selectors import field_value

#: how many past events a watch may resume from before it gets 410 Gone
HISTORY = 20000
#: per kind, the field the store keeps an index on: listing the pods of one node (what every bind and
#: every node component asks) then doesn't walk every pod of the cluster
INDEXED: dict[str, tuple[str, ...]] = {"pods": ("spec", "nodeName")}

Key = tuple[str, str]  # (namespace or "", name)


class StoreError(Exception):
    """Maps onto a Kubernetes Status reply."""

    def __init__(self, code: int, reason: str, message: str, kind: str = "", name: str = "") -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.kind, self.name = code, reason, message, kind, name


def not_found(kind: str, name: str) -> StoreError:
    return StoreError(404, "NotFound", f'{kind} "{name}" not found', kind, name)


def conflict(kind: str, name: str, why: str) -> StoreError:
    return StoreError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {kind} "{name}": {why}',
        kind,
        name,
    )


def invalid(kind: str, name: str, why: str) -> StoreError:
    return StoreError(422, "Invalid", f'{kind} "{name}" is invalid: {why}', kind, name)


@dataclass(frozen=True, slots=True)
class Event:
    rv: int
    kind: str
    type: str
    old: Mapping[str, Any] | None
    new: Mapping[str, Any]


class Store:
    """All objects of every kind, one lock, one resourceVersion counter.

    Stored objects are never changed in place (an update stores a changed copy), so reads hand out
    the stored dicts themselves; callers must treat them as read-only.
    """

    def __init__(self) -> None:
        self._objects: dict[str, dict[Key, dict[str, Any]]] = {}
        #: kind -> value of its INDEXED field -> keys of the objects with that value
        self._index: dict[str, dict[str, set[Key]]] = {}
        self._rv = 1  # like a real server, never "0": that value means "any version" to a watch
        self._history: deque[Event] = deque(maxlen=HISTORY)
        self.changed = threading.Condition()

    @property
    def resource_version(self) -> int:
        return self._rv

    def _record(self, kind: str, key: Key, type_: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        self._history.append(Event(self._rv, kind, type_, old, new))
        self._reindex(kind, key, old, None if type_ == "DELETED" else new)
        self.changed.notify_all()

    def _reindex(self, kind: str, key: Key, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> None:
        path = INDEXED.get(kind)
        if path is None:
            return
        before = None if old is None else field_value(old, path)
        after = None if new is None else field_value(new, path)
        if before == after:
            return
        index = self._index.setdefault(kind, {})
        if before is not None:
            index[before].discard(key)
            if not index[before]:
                del index[before]
        if after is not None:
            index.setdefault(after, set()).add(key)

    def list(
        self,
        kind: str,
        namespace: str | None,
        match: Callable[[Mapping[str, Any]], bool],
        indexed: str | None = None,
    ) -> tuple[list, int]:
        """The objects ``match`` accepts, by key. ``indexed`` narrows the search to the objects whose
        INDEXED field has that value (``match`` must then require the same)."""
        with self.changed:
            objects = self._objects.get(kind, {})
            if indexed is not None and kind in INDEXED:
                keys = sorted(self._index.get(kind, {}).get(indexed, ()))
            else:
                keys = sorted(objects)
            items = [objects[key] for key in keys if (namespace is None or key[0] == namespace) and match(objects[key])]
            return items, self._rv

    def get(self, kind: str, key: Key) -> dict[str, Any]:
        with self.changed:
            obj = self._objects.get(kind, {}).get(key)
            if obj is None:
                raise not_found(kind, key[1])
            return obj

    def create(self, kind: str, key: Key, obj: dict[str, Any]) -> dict[str, Any]:
        with self.changed:
            objects = self._objects.setdefault(kind, {})
            if key in objects:
                raise StoreError(409, "AlreadyExists", f'{kind} "{key[1]}" already exists', kind, key[1])
            self._rv += 1
            meta = obj.setdefault("metadata", {})
            meta["resourceVersion"] = str(self._rv)
            meta.setdefault("uid", str(uuidlib.uuid4()))
            meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            objects[key] = obj
            self._record(kind, key, "ADDED", None, obj)
            return obj

    def update(self, kind: str, key: Key, change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Apply ``change`` to a copy of the object. A resourceVersion the change sets must match."""
        with self.changed:
            objects = self._objects.get(kind, {})
            current = objects.get(key)
            if current is None:
                raise not_found(kind, key[1])
            updated = change(copy.deepcopy(current))
            meta = updated.setdefault("metadata", {})
            wanted = meta.get("resourceVersion")
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                raise conflict(
                    kind,
                    key[1],
                    "the object has been modified; please apply your changes to the latest version and try again",
                )
            for immutable in ("name", "namespace", "uid", "creationTimestamp"):
                if immutable in current["metadata"]:
                    if meta.get(immutable, current["metadata"][immutable]) != current["metadata"][immutable]:
                        raise invalid(kind, key[1], f"metadata.{immutable}: field is immutable")
                    meta[immutable] = current["metadata"][immutable]
            if updated == current:
                return current
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            objects[key] = updated
            self._record(kind, key, "MODIFIED", current, updated)
            return updated

    def delete(self, kind: str, key: Key) -> dict[str, Any]:
        with self.changed:
            obj = self._objects.get(kind, {}).pop(key, None)
            if obj is None:
                raise not_found(kind, key[1])
            self._rv += 1
            gone = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self._rv)}}
            self._record(kind, key, "DELETED", obj, gone)
            return gone

    def events_since(self, rv: int) -> list[Event] | None:
        """Events after ``rv``; None when ``rv`` is older than the history kept (410 Gone)."""
        if rv >= self._rv:
            return []
        if not self._history or rv < self._history[0].rv - 1:
            return None
        # resourceVersions are contiguous: every bump records exactly one event
        return list(itertools.islice(reversed(self._history), self._rv - rv))[::-1]
