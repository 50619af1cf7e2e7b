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

#: how many past events a watch may resume from before it gets 410 Gone
HISTORY = 20000

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
        self._rv = 1  # like a real server, never "0": that value means "any version" to a watch
        self._history: deque[Event] = deque(maxlen=HISTORY)
        self.changed = threading.Condition()

    @property
    def resource_version(self) -> int:
        return self._rv

    def _record(self, kind: str, type_: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        self._history.append(Event(self._rv, kind, type_, old, new))
        self.changed.notify_all()

    def list(self, kind: str, namespace: str | None, match: Callable[[Mapping[str, Any]], bool]) -> tuple[list, int]:
        with self.changed:
            items = [
                obj
                for (ns, _), obj in sorted(self._objects.get(kind, {}).items())
                if (namespace is None or ns == namespace) and match(obj)
            ]
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
            self._record(kind, "ADDED", None, obj)
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
            self._record(kind, "MODIFIED", current, updated)
            return updated

    def delete(self, kind: str, key: Key) -> dict[str, Any]:
        with self.changed:
            obj = self._objects.get(kind, {}).pop(key, None)
            if obj is None:
                raise not_found(kind, key[1])
            self._rv += 1
            gone = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self._rv)}}
            self._record(kind, "DELETED", obj, gone)
            return gone

    def events_since(self, rv: int) -> list[Event] | None:
        """Events after ``rv``; None when ``rv`` is older than the history kept (410 Gone)."""
        if rv >= self._rv:
            return []
        if not self._history or rv < self._history[0].rv - 1:
            return None
        # resourceVersions are contiguous: every bump records exactly one event
        return list(itertools.islice(reversed(self._history), self._rv - rv))[::-1]
