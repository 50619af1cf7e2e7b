"""The extender protocol's bodies: requests read and checked field by field, replies written as JSON.

A request's pod and node names are checked for the types the API would give them, so a malformed body
is a ``BadRequest`` (HTTP 400) naming the field at fault. Bodies use kube-scheduler's Go field names.

Replies are fast to write for the thousands of node names a filter or prioritize call carries.

Kubernetes node names are plain printable ASCII without quotes or backslashes, so JSON writes each
one as it is: a list of them can be written by joining them, several times faster than encoding
them one by one (and a prioritize reply of 5,000 ``{"Host": .., "Score": ..}`` objects needs no
objects at all). Names that are not plain are encoded by ``json`` as usual. Either way the bytes are
exactly those ``json.dumps`` writes.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

_SEPARATOR = '", "'
#: printable ASCII but the backslash: what a plain name is made of (quotes are counted apart)
_PLAIN = bytes(range(0x20, 0x7F)).replace(b"\\", b"")
_HOST = '{"Host": "'
_NEXT_HOST = ", " + _HOST


@dataclass(frozen=True, slots=True)
class Raw:
    """Text that is JSON already; ``encode`` writes it as it is in place of a top-level value."""

    text: str


@dataclass(frozen=True, slots=True)
class NodeNames:
    """The node names of a request, with ``text`` (the names joined by ``", "``) when all are plain."""

    names: list[str]
    text: str | None

    @classmethod
    def of(cls, names: list[str]) -> NodeNames:
        """Raises TypeError when an item is not a string."""
        text = _SEPARATOR.join(names)
        plain = (
            text.isascii()
            and text.count('"') == 2 * max(len(names) - 1, 0)
            and not text.encode("ascii").translate(None, _PLAIN)
        )
        return cls(names, text if plain else None)

    def __len__(self) -> int:
        return len(self.names)

    def json(self) -> Raw | list[str]:
        """The names as a JSON list."""
        if self.text is None:
            return self.names
        return Raw(f'["{self.text}"]' if self.names else "[]")

    def priorities(self, scores: np.ndarray) -> Raw | list[dict[str, Any]]:
        """A HostPriorityList: ``[{"Host": name, "Score": score}]`` in the order of the names, for the
        names that score above 0. kube-scheduler adds an extender's score times its weight to each node
        the list names, so a node left out counts as a 0 (``prioritizeNodes``, 1.20 to 1.37), and it
        decodes the list with reflection: a GPU pod's reply from the CPU-and-memory entry, all zeros,
        cost it half a millisecond at 420 nodes before it became ``[]``."""
        scored = np.flatnonzero(scores)
        names = [self.names[i] for i in scored.tolist()] if len(scored) < len(self.names) else self.names
        scores = scores[scored]
        if self.text is None:
            return [{"Host": n, "Score": s} for n, s in zip(names, scores.tolist(), strict=True)]
        if not names:
            return Raw("[]")
        # name, tail, name, tail, ...: each tail closes its object and opens the next one's Host
        low = int(scores.min())
        tails = np.array([f'", "Score": {s}}}{_NEXT_HOST}' for s in range(low, int(scores.max()) + 1)], dtype=object)
        parts = [""] * (2 * len(names))
        parts[::2] = names
        parts[1::2] = tails[scores - low].tolist()
        return Raw(f"[{_HOST}{''.join(parts)[: -len(_NEXT_HOST)]}]")


def encode(reply: Any) -> bytes:
    """``json.dumps(reply)`` as bytes, with ``Raw`` text in place of the reply or of its top-level values."""
    if isinstance(reply, Raw):
        return reply.text.encode()
    if isinstance(reply, dict) and any(isinstance(value, Raw) for value in reply.values()):
        items = (f"{json.dumps(key)}: {_text(value)}" for key, value in reply.items())
        return f"{{{', '.join(items)}}}".encode()
    # replies are plain trees; skipping the cycle check halves the time for 5,000 nodes
    return json.dumps(reply, check_circular=False).encode()


def _text(value: Any) -> str:
    return value.text if isinstance(value, Raw) else json.dumps(value, check_circular=False)


class BadRequest(ValueError):
    """The body isn't an extender request: HTTP 400."""


def _expect(value: Any, kind: type, where: str) -> Any:
    """``value`` when it is absent or of ``kind``; BadRequest naming the field otherwise."""
    if value is not None and not isinstance(value, kind):
        raise BadRequest(f"{where} must be {'an object' if kind is dict else 'a list' if kind is list else 'a string'}")
    return value


def _check_pod(pod: Mapping[str, Any]) -> None:
    """Every field of the pod the verbs read has the type the API would give it."""
    meta = _expect(pod.get("metadata"), dict, "Pod.metadata") or {}
    for field in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp"):
        _expect(meta.get(field), str, f"Pod.metadata.{field}")
    for field in ("annotations", "labels"):
        for value in (_expect(meta.get(field), dict, f"Pod.metadata.{field}") or {}).values():
            _expect(value, str, f"Pod.metadata.{field} values")
    spec = _expect(pod.get("spec"), dict, "Pod.spec") or {}
    _expect(pod.get("status"), dict, "Pod.status")
    _expect(spec.get("nodeSelector"), dict, "Pod.spec.nodeSelector")
    for group in ("initContainers", "containers"):
        for item in _expect(spec.get(group), list, f"Pod.spec.{group}") or []:
            where = f"Pod.spec.{group}[]"
            resources = _expect(_expect(item, dict, where).get("resources"), dict, f"{where}.resources") or {}
            _expect(item.get("name"), str, f"{where}.name")
            _expect(resources.get("limits"), dict, f"{where}.resources.limits")
            _expect(resources.get("requests"), dict, f"{where}.resources.requests")


def check_victims(body: Mapping[str, Any]) -> None:
    for field, inner, kind in (("NodeNameToMetaVictims", "UID", str), ("NodeNameToVictims", "metadata", dict)):
        for entry in (_expect(body.get(field), dict, field) or {}).values():
            for victim in _expect(_expect(entry, dict, f"{field} entries").get("Pods"), list, f"{field}[].Pods") or []:
                _expect(_expect(victim, dict, f"{field}[].Pods[]").get(inner), kind, f"{field}[].Pods[].{inner}")


def request_pod(body: Any) -> Mapping[str, Any]:
    """The request's pod, its shape checked (BadRequest names the first field that is wrong)."""
    if not isinstance(body, dict) or not isinstance(body.get("Pod"), dict):
        raise BadRequest("the body must be a JSON object with a Pod")
    _check_pod(body["Pod"])
    return body["Pod"]


def candidate_names(body: Mapping[str, Any]) -> tuple[NodeNames, bool]:
    """Node names from ``NodeNames`` (nodeCacheCapable) or ``Nodes.items``; and whether Nodes was used."""
    if body.get("NodeNames") is not None:
        names = body["NodeNames"]
        if isinstance(names, list):
            with contextlib.suppress(TypeError):  # an item that is not a string
                return NodeNames.of(names), False
        raise BadRequest("NodeNames must be a list of strings")
    nodes = body.get("Nodes")
    if isinstance(nodes, dict):
        items = _expect(nodes.get("items"), list, "Nodes.items") or []
        metas = [
            _expect(_expect(n, dict, "Nodes.items[]").get("metadata"), dict, "Nodes.items[].metadata") for n in items
        ]
        names = [_expect((m or {}).get("name", ""), str, "Nodes.items[].metadata.name") for m in metas]
        return NodeNames.of(names), True
    raise BadRequest("the body must carry NodeNames or Nodes")


def refused_nodes(failed: Mapping[str, str], unresolvable: Mapping[str, str]) -> dict[str, str]:
    """Each node a filter reply refuses, with the reason kube-scheduler shows for it: a node in both maps
    counts as unresolvable (``findNodesThatPassExtenders``)."""
    return {**failed, **unresolvable}


def reason_histogram(reasons: Iterable[str]) -> list[str]:
    """kube-scheduler's summary of refusals (``FitError.Error``): ``"<count> <reason>"`` for each
    distinct reason, sorted as text."""
    return sorted(f"{count} {reason}" for reason, count in Counter(reasons).items())
