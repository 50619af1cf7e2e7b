"""What a pod asks of its cards beyond memory: the card models it accepts or avoids, whether its
cards must be NVLink peers or share a NUMA node, and whether the driver must enforce its memory share.
The pod's owner writes these annotations; placement (:class:`gpushare.placement.CardRule`) decides
what they allow.

``gpushare.io/gpu-model: "A100-80GB|A100-40GB"`` and ``gpushare.io/gpu-model-avoid: "T4"`` hold
``|``-separated model patterns; ``gpushare.io/require-nvlink``, ``gpushare.io/require-same-numa`` and
``gpushare.io/require-memory-limit`` hold ``"true"`` or ``"false"``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from gpushare.contract.errors import AnnotationError, quoted
from gpushare.contract.names import (
    ANN_GPU_MODEL,
    ANN_GPU_MODEL_AVOID,
    ANN_REQUIRE_MEMORY_LIMIT,
    ANN_REQUIRE_NVLINK,
    ANN_REQUIRE_SAME_NUMA,
    CARD_RULE_ANNOTATIONS,
)
from gpushare.contract.request import annotations_of, pod_key
from gpushare.placement.demand import ANY_CARD, CardRule

#: what a model pattern may hold: the characters of NVML's product names
_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()/+-]*")
#: longest model annotation read; a real list of models is far shorter
MODELS_LIMIT = 1024


def parse_models(text: str, where: str) -> frozenset[str]:
    """The patterns of a ``|``-separated model list (empty entries skipped); raises AnnotationError
    naming ``where``."""
    if len(text) > MODELS_LIMIT:
        raise AnnotationError(f"{where}: {quoted(text)} is longer than {MODELS_LIMIT} characters")
    patterns = [part.strip() for part in text.split("|") if part.strip()]
    if not patterns:
        raise AnnotationError(f"{where}: names no card model (expected e.g. 'A100-80GB|A100-40GB')")
    for pattern in patterns:
        if not _PATTERN.fullmatch(pattern):
            raise AnnotationError(
                f"{where}: {quoted(pattern)} is not a card model (letters, digits, spaces and ._()/+- only, "
                "models separated by '|')"
            )
    return frozenset(patterns)


def format_models(models: Iterable[str]) -> str:
    return "|".join(sorted(models))


def parse_requirement(text: str, where: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise AnnotationError(f"{where}: {quoted(text)} is neither 'true' nor 'false'")
    return value == "true"


def format_requirement(value: bool) -> str:
    return "true" if value else "false"


def parse_card_rule(pod: Mapping[str, Any]) -> CardRule:
    """The pod's :class:`CardRule` from its annotations (no annotation: any card); raises
    AnnotationError naming the pod and the annotation at fault."""
    return card_rule_of(annotations_of(pod), pod_key(pod))


def card_rule_of(annotations: Mapping[str, str], key: str) -> CardRule:
    """:func:`parse_card_rule` from the annotations of the pod ``key`` (namespace/name)."""
    if not any(name in annotations for name in CARD_RULE_ANNOTATIONS):
        return ANY_CARD

    def read(name: str, parse: Any, default: Any) -> Any:
        text = annotations.get(name)
        return default if text is None else parse(str(text), f"pod {key} annotation {name}")

    return CardRule(
        models=read(ANN_GPU_MODEL, parse_models, frozenset()),
        avoid=read(ANN_GPU_MODEL_AVOID, parse_models, frozenset()),
        nvlink=read(ANN_REQUIRE_NVLINK, parse_requirement, False),
        same_numa=read(ANN_REQUIRE_SAME_NUMA, parse_requirement, False),
        memory_limits=read(ANN_REQUIRE_MEMORY_LIMIT, parse_requirement, False),
    )


def card_rule_annotations(rule: CardRule) -> dict[str, str]:
    """The annotations that ask for ``rule`` (the inverse of :func:`parse_card_rule`)."""
    annotations = {}
    if rule.models:
        annotations[ANN_GPU_MODEL] = format_models(rule.models)
    if rule.avoid:
        annotations[ANN_GPU_MODEL_AVOID] = format_models(rule.avoid)
    if rule.nvlink:
        annotations[ANN_REQUIRE_NVLINK] = format_requirement(True)
    if rule.same_numa:
        annotations[ANN_REQUIRE_SAME_NUMA] = format_requirement(True)
    if rule.memory_limits:
        annotations[ANN_REQUIRE_MEMORY_LIMIT] = format_requirement(True)
    return annotations
