"""The CDI spec of a prepared claim, and writing it where containerd reads CDI specs.

One spec file per claim, kind ``gpu.gpushare.io/claim``, one CDI device per request of the claim,
named ``<claim UID>-<request>``. A device sets one variable of its own, ``GPUSHARE_CLAIM_<UID>_<REQUEST>``
(its cards' UUIDs): the GPU env a container sees (``NVIDIA_VISIBLE_DEVICES``, ``ALIYUN_COM_GPU_MEM_*``) is
set by the CRI shim over all of the container's claims, since the runtime would give it only the last
device's value of a variable several devices set (:func:`gpushare.holdings.dra.dra_env`).

The spec's annotations record the claim and the memory it holds on each card, in bytes
(:func:`gpushare.contract.dra.format_card_memory`): the spec files are the plugin's record of what it
prepared, read again before each claim (:func:`prepared_memory`), across restarts.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpushare.cards import Card
from gpushare.contract.dra import format_card_memory, format_claim_cdi_device, format_claim_env_key, parse_card_memory
from gpushare.contract.errors import ContractError
from gpushare.contract.names import DRA_CDI_KIND, DRA_DRIVER, DRA_SPEC_ANN_CLAIM, DRA_SPEC_ANN_MEMORY
from gpushare.contract.resourceclaim import ClaimAllocation, card_slices

#: the oldest CDI version with everything the spec uses (env edits, annotations); containerd 2.2.9 reads 0.3.0 to 1.1.0
CDI_VERSION = "0.6.0"
DEFAULT_SPEC_DIR = Path("/var/run/cdi")
SPEC_PREFIX = f"{DRA_DRIVER}-claim_"


class SpecError(ContractError):
    """A spec file of this driver that doesn't say what its claim holds."""


def spec_file_name(uid: str) -> str:
    return f"{SPEC_PREFIX}{uid}.json"


def cdi_spec(allocation: ClaimAllocation, cards: Sequence[Card], unit_mib: int) -> dict[str, Any]:
    """The CDI spec of the claim: one device per request, and what the claim holds in its annotations."""
    grouped = card_slices(allocation, cards, unit_mib)
    uuid_of = {c.index: c.uuid for c in cards}
    held: dict[str, int] = {}
    for share in allocation.shares:
        held[uuid_of[share.index]] = held.get(uuid_of[share.index], 0) + share.memory_bytes
    devices = [
        {
            "name": format_claim_cdi_device(allocation.claim.uid, request).removeprefix(f"{DRA_CDI_KIND}="),
            "containerEdits": {
                "env": [f"{format_claim_env_key(allocation.claim.uid, request)}={','.join(s.uuid for s in slices)}"]
            },
        }
        for request, slices in grouped.items()
    ]
    annotations = {
        DRA_SPEC_ANN_CLAIM: f"{allocation.claim.namespace}/{allocation.claim.name}",
        DRA_SPEC_ANN_MEMORY: format_card_memory(held),
    }
    return {"cdiVersion": CDI_VERSION, "kind": DRA_CDI_KIND, "annotations": annotations, "devices": devices}


def prepared_memory(spec_dir: Path) -> dict[str, dict[str, int]]:
    """What each claim with a spec in ``spec_dir`` holds: claim UID -> bytes per card UUID. A spec file of
    this driver that doesn't say is a :class:`SpecError` naming it (or, when its annotation is malformed,
    a :class:`~gpushare.contract.dra.DraMemoryError`): what it holds can't be left out."""
    prepared = {}
    for path in sorted(spec_dir.glob(f"{SPEC_PREFIX}*.json")):
        where = f"CDI spec {path}"
        try:
            spec = json.loads(path.read_text())
        except FileNotFoundError:
            continue  # unprepared meanwhile
        except (OSError, ValueError) as exc:
            raise SpecError(f"{where} can't be read ({exc}), so what its claim holds can't be counted") from None
        annotations = spec.get("annotations") if isinstance(spec, dict) else None
        memory = annotations.get(DRA_SPEC_ANN_MEMORY) if isinstance(annotations, dict) else None
        prepared[path.name.removeprefix(SPEC_PREFIX).removesuffix(".json")] = parse_card_memory(
            memory, f"{where} annotation {DRA_SPEC_ANN_MEMORY}"
        )
    return prepared


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
