"""Keys on a pod that gpushare would silently ignore: an annotation or label under ``gpushare.io/`` it
doesn't read, a key a typo away from one it reads (``gpushare.io/gpu-modle``, ``gpushare.oi/gpu-model``),
and a container resource under ``aliyun.com/`` it doesn't offer. Pure: the admission webhook returns them
as warnings and the extender records them as an Event, each naming the nearest key gpushare reads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.contract.errors import quoted
from gpushare.contract.names import KNOWN_POD_ANNOTATIONS, KNOWN_POD_LABELS, RESOURCES

#: a key at most this many edits (insert, delete, substitute, swap two neighbours) from a known key is
#: taken for a misspelling of it
NEAR_MISS_EDITS = 2
#: the prefixes under which every key is gpushare's: anything unknown there is a mistake
GPUSHARE_PREFIX = "gpushare.io/"
RESOURCE_PREFIX = "aliyun.com/"
#: keys named at most (the API server shows a few warnings, not thousands)
MAX_NAMED = 10
#: keys compared with the known ones at most: each comparison costs up to one edit-distance table per
#: known key, and a pod may carry thousands of keys
MAX_COMPARED = 32
NO_SUCH_KEY = "it reads no such key"


@dataclass(frozen=True, slots=True)
class UnknownKey:
    """A key gpushare ignores: ``where`` is "annotation", "label" or "container NAME's resource"."""

    where: str
    key: str
    #: the known key it most likely meant, or "" when none is close
    nearest: str = ""
    #: what the message says when no known key is close
    otherwise: str = NO_SUCH_KEY

    def message(self) -> str:
        text = f"gpushare ignores {self.where} {quoted(self.key)}"
        return f"{text}: did you mean {self.nearest!r}?" if self.nearest else f"{text}: {self.otherwise}"


def edit_distance(a: str, b: str, limit: int = NEAR_MISS_EDITS) -> int:
    """The optimal-string-alignment distance of ``a`` and ``b`` (a swap of two neighbours is one edit),
    or ``limit + 1`` once it is certain to exceed ``limit``. Our own rather than ``difflib``'s: its
    similarity ratio counts no edits, so no cut-off of it means "a typo away" for short and long keys
    alike, and the bounded table stops early on keys that are plainly different."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    before: list[int] | None = None
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if before is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], before[j - 2] + 1)
        if min(current) > limit:
            return limit + 1
        before, previous = previous, current
    return previous[-1]


def nearest_key(key: str, known: Iterable[str]) -> str:
    """The known key closest to ``key`` within :data:`NEAR_MISS_EDITS` (the first in sorted order on a
    tie), or ""."""
    best, best_distance = "", NEAR_MISS_EDITS + 1
    for candidate in sorted(known):
        distance = edit_distance(key, candidate)
        if distance < best_distance:
            best, best_distance = candidate, distance
    return best


@dataclass(frozen=True, slots=True)
class _Candidate:
    where: str
    key: str
    known: frozenset[str]
    prefix: str
    otherwise: str = NO_SUCH_KEY


def _candidates(pod: Mapping[str, Any], old: Mapping[str, Any] | None) -> list[_Candidate]:
    """The pod's keys that gpushare doesn't know, each with where it sits, what gpushare knows there and
    what the message says when no known key is close."""
    meta, old_meta = pod.get("metadata") or {}, (old or {}).get("metadata") or {}
    found = []
    for where, field, known in (
        ("annotation", "annotations", KNOWN_POD_ANNOTATIONS),
        ("label", "labels", KNOWN_POD_LABELS),
    ):
        keys, before = meta.get(field) or {}, old_meta.get(field) or {}
        if isinstance(keys, Mapping) and isinstance(before, Mapping):
            found += [_Candidate(where, k, known, GPUSHARE_PREFIX) for k in keys if k not in before and k not in known]
    if old is not None:
        return found
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if not isinstance(container, Mapping):
            continue
        resources = container.get("resources") or {}
        parts = [resources.get("limits"), resources.get("requests")]
        asked = {key for part in parts if isinstance(part, Mapping) for key in part if key not in RESOURCES}
        where = f"container {quoted(container.get('name', '?'))}'s resource"
        offered = f"its resources are {' and '.join(RESOURCES)}"
        found += [_Candidate(where, k, frozenset(RESOURCES), RESOURCE_PREFIX, offered) for k in sorted(asked)]
    return found


def unknown_keys(pod: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[UnknownKey]:
    """The annotations, labels and container resources of ``pod`` that gpushare ignores although they
    look like its own, at most :data:`MAX_NAMED`, those under gpushare's prefixes first; with ``old``
    (the pod before an update), only the annotations and labels the update adds (a pod's resources were
    checked when it was created). At most :data:`MAX_COMPARED` keys are compared with the known ones,
    so a pod with thousands of annotations costs no more than an ordinary one."""
    candidates = sorted(_candidates(pod, old), key=lambda c: (not c.key.startswith(c.prefix), c.where, c.key))
    found: list[UnknownKey] = []
    for compared, candidate in enumerate(candidates):
        if len(found) == MAX_NAMED:
            break
        nearest = nearest_key(candidate.key, candidate.known) if compared < MAX_COMPARED else ""
        if nearest or candidate.key.startswith(candidate.prefix):
            found.append(UnknownKey(candidate.where, candidate.key, nearest, candidate.otherwise))
    return found
