"""The CDI spec of a prepared claim, and writing it where containerd reads CDI specs.

One spec file per claim, kind ``gpu.gpushare.io/claim``, one CDI device per request of the claim,
named ``<claim UID>-<request>``. Its environment is the one the device plugin gives a container for the
same cards and units (:func:`gpushare.contract.env.assigned_env`), so a workload sees the same
variables whichever way its cards were allocated.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpushare.cards import Card
from gpushare.contract.env import assigned_env
from gpushare.contract.names import DRA_CDI_KIND, DRA_DRIVER
from gpushare.contract.resourceclaim import ClaimAllocation, card_slices

#: the oldest CDI version with everything the spec uses (env edits); containerd 2.2.9 reads 0.3.0 to 1.1.0
CDI_VERSION = "0.6.0"
DEFAULT_SPEC_DIR = Path("/var/run/cdi")


def cdi_device_name(uid: str, request: str) -> str:
    return f"{uid}-{request}"


def cdi_device_id(uid: str, request: str) -> str:
    """The fully qualified CDI name kubelet hands the runtime."""
    return f"{DRA_CDI_KIND}={cdi_device_name(uid, request)}"


def spec_file_name(uid: str) -> str:
    return f"{DRA_DRIVER}-claim_{uid}.json"


def cdi_spec(allocation: ClaimAllocation, cards: Sequence[Card], unit_mib: int) -> dict[str, Any]:
    """The CDI spec that gives each request's containers the env for its cards."""
    grouped = card_slices(allocation, cards, unit_mib)
    card_units = {c.uuid: c.memory_mib // unit_mib for c in cards}
    claim_units = sum(s.units for slices in grouped.values() for s in slices)
    devices = [
        {
            "name": cdi_device_name(allocation.claim.uid, request),
            "containerEdits": {
                "env": [f"{k}={v}" for k, v in assigned_env(slices, claim_units, card_units).items()],
            },
        }
        for request, slices in grouped.items()
    ]
    return {"cdiVersion": CDI_VERSION, "kind": DRA_CDI_KIND, "devices": devices}


def write_spec(spec_dir: Path, uid: str, spec: dict[str, Any]) -> Path:
    """Write the claim's spec atomically (a reader sees the old file or the new one, never a part)."""
    spec_dir.mkdir(parents=True, exist_ok=True)
    path = spec_dir / spec_file_name(uid)
    fd, tmp = tempfile.mkstemp(dir=spec_dir, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_spec(spec_dir: Path, uid: str) -> bool:
    """Remove the claim's spec; False when there was none (already unprepared)."""
    try:
        (spec_dir / spec_file_name(uid)).unlink()
    except FileNotFoundError:
        return False
    return True
