"""Field and label selectors as the Kubernetes API server understands them (the subset we serve)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Predicate = Callable[[Mapping[str, Any]], bool]

_METADATA = ("metadata.name", "metadata.namespace")
#: the field selectors kube-apiserver 1.37 accepts, per resource; any other field is refused with 400
FIELDS: dict[str, tuple[str, ...]] = {
    "pods": (
        *_METADATA,
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ),
    "nodes": (*_METADATA, "spec.unschedulable"),
    "events": (
        *_METADATA,
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    ),
    "configmaps": _METADATA,
    "namespaces": (*_METADATA, "status.phase"),
}
#: where a selectable field lives in the object, when not at its own dotted path
_PATHS = {"source": ("source", "component"), "reportingComponent": ("reportingComponent",)}
#: what a selector compares an absent field with, when not the empty string (Go's zero value)
_ABSENT = {("spec", "hostNetwork"): "false"}


class SelectorError(ValueError):
    """A selector the API server would reject with 400."""


def field_value(obj: Mapping[str, Any], path: tuple[str, ...]) -> str:
    """The field at ``path`` as a selector compares it: a string, empty when absent."""
    value: Any = obj
    for part in path:
        value = (value or {}).get(part) if isinstance(value, Mapping) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return _ABSENT.get(path, "") if value is None else str(value)


@dataclass(frozen=True, slots=True)
class FieldSelector:
    """A parsed field selector: ``(path, negated, value)`` terms that must all hold."""

    terms: tuple[tuple[tuple[str, ...], bool, str], ...] = ()

    def __call__(self, obj: Mapping[str, Any]) -> bool:
        return all((field_value(obj, path) == value) != negate for path, negate, value in self.terms)

    def required(self, path: tuple[str, ...]) -> str | None:
        """The value every matching object has at ``path`` (from an ``=`` term), or None."""
        return next((value for term, negate, value in self.terms if term == path and not negate), None)


def parse_field_selector(text: str | None, resource: str) -> FieldSelector:
    """``resource`` (``pods``, ``events``, ...) decides which fields may be selected on."""
    if not text:
        return FieldSelector()
    terms = []
    for raw in text.split(","):
        m = re.fullmatch(r"\s*([A-Za-z.]+)\s*(==|!=|=)\s*([^,]*?)\s*", raw)
        if not m:
            raise SelectorError(f"invalid field selector term {raw!r}")
        key, op, value = m.groups()
        if key not in FIELDS.get(resource, _METADATA):
            raise SelectorError(f'field label not supported for {resource}: "{key}"')
        terms.append((_PATHS.get(key, tuple(key.split("."))), op == "!=", value))
    return FieldSelector(tuple(terms))


_LABEL_TERM = re.compile(
    r"\s*(?:(?P<not>!)\s*(?P<nkey>[\w./-]+)"
    r"|(?P<skey>[\w./-]+)\s+(?P<setop>in|notin)\s+\((?P<values>[^)]*)\)"
    r"|(?P<ekey>[\w./-]+)\s*(?P<op>==|!=|=)\s*(?P<value>[\w./-]*)"
    r"|(?P<key>[\w./-]+))\s*"
)


def _split_label_terms(text: str) -> list[str]:
    """Split on commas that are not inside an ``in (...)`` value list."""
    terms, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return terms


def parse_label_selector(text: str | None) -> Predicate:
    if not text:
        return lambda _obj: True
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for raw in _split_label_terms(text):
        m = _LABEL_TERM.fullmatch(raw)
        if not m:
            raise SelectorError(f"invalid label selector term {raw!r}")
        if m["nkey"]:
            checks.append(lambda labels, k=m["nkey"]: k not in labels)
        elif m["skey"]:
            values = {v.strip() for v in m["values"].split(",") if v.strip()}
            inside = m["setop"] == "in"
            checks.append(
                lambda labels, k=m["skey"], vs=values, inside=inside: (k in labels and labels[k] in vs) == inside
            )
        elif m["ekey"]:
            negate = m["op"] == "!="
            checks.append(lambda labels, k=m["ekey"], v=m["value"], n=negate: (labels.get(k) == v) != n)
        else:
            checks.append(lambda labels, k=m["key"]: k in labels)
    return lambda obj: all(check((obj.get("metadata") or {}).get("labels") or {}) for check in checks)
