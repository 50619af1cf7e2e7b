"""The three patch formats the Kubernetes API accepts, over plain JSON values.

Strategic merge patch differs from a JSON merge patch only in lists: the core/v1 lists that carry a
merge key (conditions by ``type``, containers by ``name``, ...) are merged item by item, and an item
carrying ``"$patch": "delete"`` removes its match. Other lists are replaced, as in a merge patch.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
SUPPORTED = (MERGE, STRATEGIC, JSON_PATCH)
#: server-side apply: refused (415) unless a fieldManager is named (422), which the stand-in doesn't implement
APPLY = "application/apply-patch+yaml"


class PatchError(ValueError):
    """A patch that can't be applied (422), or whose ``test`` operation failed."""


class UndecodablePatch(PatchError):
    """A merge patch that isn't a JSON object: kube-apiserver (1.27+, which validates fields by
    default) refuses it with 400 BadRequest before looking at the object."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


#: core/v1 list fields merged by key under a strategic merge patch (field name -> merge key)
MERGE_KEYS = {
    "conditions": "type",
    "addresses": "type",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "ephemeralContainerStatuses": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "ownerReferences": "uid",
}
DIRECTIVE = "$patch"


def _merge_list(target: list[Any], patch: list[Any], key: str) -> list[Any]:
    """Merge by ``key`` in the order kube-apiserver gives: the patch's items (merged into the stored
    ones they name) and the stored items the patch leaves alone, interleaved so that two items both
    stored before keep their stored order, and a new item comes before any untouched one still to come."""
    server_order = [old.get(key) for old in target if isinstance(old, dict)]
    stored = {old.get(key): old for old in target if isinstance(old, dict)}
    patched: list[Any] = []
    deleted: set[Any] = set()
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"every item of a list merged by {key!r} needs that key, got {item!r}")
        if item.get(DIRECTIVE) == "delete":
            deleted.add(item[key])
        else:
            patched.append(strategic_merge_patch(stored.get(item[key], {}), item))
    touched = deleted | {item[key] for item in patched}
    untouched = [old for old in target if not (isinstance(old, dict) and old.get(key) in touched)]

    def before(left: Any, right: Any) -> bool:
        where = left.get(key) if isinstance(left, dict) else None
        if where not in server_order or right[key] not in server_order:
            return False
        return server_order.index(where) < server_order.index(right[key])

    result: list[Any] = []
    while untouched and patched:
        result.append(untouched.pop(0) if before(untouched[0], patched[0]) else patched.pop(0))
    return result + untouched + patched


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Kubernetes strategic merge patch, for the core/v1 lists named in :data:`MERGE_KEYS`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if name == DIRECTIVE:
            continue
        if value is None:
            result.pop(name, None)
        elif name in MERGE_KEYS and isinstance(value, list) and isinstance(result.get(name), list):
            result[name] = _merge_list(result[name], value, MERGE_KEYS[name])
        else:
            result[name] = strategic_merge_patch(result.get(name), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise PatchError(f"path {path!r} does not exist")
    return node, parts[-1]


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent, last = _parent(doc, parts, path)
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise PatchError(f"path {path!r} does not exist")


def _remove(doc: Any, path: str) -> Any:
    parent, last = _parent(doc, _pointer(path), path)
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise PatchError(f"path {path!r} does not exist")


def _add(doc: Any, path: str, value: Any, replace: bool) -> Any:
    parts = _pointer(path)
    if not parts:
        return copy.deepcopy(value)
    parent, last = _parent(doc, parts, path)
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise PatchError(f"path {path!r} does not exist")
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        if last == "-" and not replace:
            parent.append(copy.deepcopy(value))
        elif last.isdigit() and int(last) <= len(parent) - replace:
            if replace:
                parent[int(last)] = copy.deepcopy(value)
            else:
                parent.insert(int(last), copy.deepcopy(value))
        else:
            raise PatchError(f"path {path!r} is out of range")
    else:
        raise PatchError(f"path {path!r} does not exist")
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 (add, remove, replace, move, copy, test)."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"malformed JSON patch operation {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"test operation failed at {path!r}")
        elif kind == "remove":
            _remove(doc, path)
        elif kind in ("add", "replace"):
            doc = _add(doc, path, op.get("value"), replace=kind == "replace")
        elif kind in ("move", "copy"):
            source = op.get("from", "")
            value = _remove(doc, source) if kind == "move" else copy.deepcopy(_get(doc, source))
            doc = _add(doc, path, value, replace=False)
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}")
    return doc


def apply_patch(content_type: str, target: Any, patch: Any) -> Any:
    if content_type == JSON_PATCH:
        return json_patch(target, patch)
    if not isinstance(patch, dict):
        kind = "array" if isinstance(patch, list) else type(patch).__name__
        raise UndecodablePatch(
            f"error decoding patch: json: cannot unmarshal {kind} into Go value of type map[string]interface {{}}"
        )
    if content_type == STRATEGIC:
        return strategic_merge_patch(target, patch)
    return merge_patch(target, patch)
