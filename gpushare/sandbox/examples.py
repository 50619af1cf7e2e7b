"""The example pods of deploy/examples, which ``gpushare sandbox`` runs and the e2e tests check."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


def load_examples(directory: Path = EXAMPLES) -> list[dict[str, Any]]:
    manifests = [yaml.safe_load(p.read_text()) for p in sorted(directory.glob("*.yaml"))]
    return [m for m in manifests if m and m.get("kind") == "Pod"]


def with_string_quantities(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Resource quantities as the API serves them (strings); YAML reads ``gpu-mem: 8`` as a number."""
    body = copy.deepcopy(dict(manifest))
    spec = body.get("spec") or {}
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        for field_name in ("limits", "requests"):
            values = (container.get("resources") or {}).get(field_name) or {}
            for key, value in values.items():
                values[key] = str(value)
    return body
