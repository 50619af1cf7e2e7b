"""The CreateContainer decision, pure: given the container's config as kubelet sent it, its resolved
assignment and the node's cards, say whether to forward it unchanged, forward a corrected copy, or
refuse it.

The device plugin can't tell pods apart in Allocate, so what it injected (its annotations and env) may
belong to another pod. Whenever that differs from the assignment, every GPU-related part of the
config is rebuilt from the assignment: env, annotations and, when enabled, device nodes and CDI names.
A container whose cards come from DRA claims keeps its claims' CDI devices (the runtime applies them)
and gets the GPU env of all their cards set here: each claim's CDI spec could only name its own cards,
and the runtime would keep the last one's (see :func:`gpushare.usage.dra_env`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpushare.crishim.resolve import DRA_CLAIM, Resolution, plugin_view

from gpushare.assignment import Refusal, check_assignment, describe
from gpushare.cards import Card
from gpushare.contract.env import assigned_env
from gpushare.contract.names import (
    CDI_KIND,
    CTR_ANN_CARDS,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD,
    CTR_ANN_POD_UID,
    DEV_CONTROL_FILES,
    ENV_VISIBLE_DEVICES,
    VISIBLE_DEVICES_VOID,
    cdi_device_name,
    device_file,
)
from gpushare.contract.units import MemoryUnit
from gpushare.pb import cri_pb2
from gpushare.settings import RewriteOptions

_CARD_DEVICE = re.compile(r"^/dev/nvidia[0-9]+$")
DEFAULT_DEVICE_PERMISSIONS = "rw"


@dataclass(frozen=True, slots=True)
class Outcome:
    """``config`` is None when the request goes through untouched. ``reason`` labels a correction
    worth reporting (metric, log, event); a silent hardening leaves it empty."""

    config: cri_pb2.ContainerConfig | None = None
    refusal: Refusal | None = None
    reason: str = ""
    message: str = ""


def env_values(config: cri_pb2.ContainerConfig, key: str) -> list[str]:
    return [kv.value for kv in config.envs if kv.key == key]


def with_env(config: cri_pb2.ContainerConfig, values: dict[str, str]) -> None:
    """Set each key exactly once (duplicates would leave the winner up to the runtime)."""
    kept = [kv for kv in config.envs if kv.key not in values]
    del config.envs[:]
    config.envs.extend(kept)
    config.envs.extend(cri_pb2.KeyValue(key=k, value=v) for k, v in values.items())


def with_devices(config: cri_pb2.ContainerConfig, cards: Sequence[Card]) -> None:
    """Replace the per-card device nodes; keep (or add) the control devices every GPU container needs."""
    old = [d for d in config.devices if _CARD_DEVICE.match(d.host_path) or _CARD_DEVICE.match(d.container_path)]
    permissions = old[0].permissions if old else DEFAULT_DEVICE_PERMISSIONS
    kept = [d for d in config.devices if d not in old]
    present = {d.host_path for d in kept}
    wanted = [device_file(c.minor) for c in cards] + [p for p in DEV_CONTROL_FILES if p not in present]
    del config.devices[:]
    config.devices.extend(kept)
    config.devices.extend(cri_pb2.Device(container_path=p, host_path=p, permissions=permissions) for p in wanted)


def with_cdi(config: cri_pb2.ContainerConfig, cards: Sequence[Card]) -> None:
    kept = [d for d in config.CDI_devices if not d.name.startswith(f"{CDI_KIND}=")]
    del config.CDI_devices[:]
    config.CDI_devices.extend(kept)
    config.CDI_devices.extend(cri_pb2.CDIDevice(name=cdi_device_name(c.uuid)) for c in cards)


def _no_gpu(config: cri_pb2.ContainerConfig, resolution: Resolution, options: RewriteOptions) -> Outcome:
    """A container without a GPU request gets ``void``: whatever its spec or image says, the NVIDIA
    runtime then exposes no card to it."""
    if not options.block_unrequested_gpu:
        return Outcome()
    current = env_values(config, ENV_VISIBLE_DEVICES)
    if current == [VISIBLE_DEVICES_VOID]:
        return Outcome()
    fixed = cri_pb2.ContainerConfig()
    fixed.CopyFrom(config)
    with_env(fixed, {ENV_VISIBLE_DEVICES: VISIBLE_DEVICES_VOID})
    if not current:
        return Outcome(config=fixed)
    return Outcome(
        config=fixed,
        reason="unrequested-gpu",
        message=f"{resolution.target}: requests no GPU but sets {ENV_VISIBLE_DEVICES}={','.join(current)}; "
        f"replaced with {VISIBLE_DEVICES_VOID}",
    )


def _dra(config: cri_pb2.ContainerConfig, resolution: Resolution) -> Outcome:
    """The container's config with the env of every card its claims give it, in place of whatever its
    spec set for those variables."""
    if resolution.dra_env is None:  # never forwarded without the env of its cards
        return Outcome(refusal=Refusal(DRA_CLAIM, f"{resolution.target}: its ResourceClaims' cards were not resolved"))
    fixed = cri_pb2.ContainerConfig()
    fixed.CopyFrom(config)
    with_env(fixed, dict(resolution.dra_env))
    return Outcome(config=fixed)


def rewrite(
    config: cri_pb2.ContainerConfig,
    resolution: Resolution,
    cards: Sequence[Card],
    unit: MemoryUnit,
    options: RewriteOptions,
) -> Outcome:
    if resolution.refusal is not None:
        return Outcome(refusal=resolution.refusal)
    if resolution.dra_devices:
        return _dra(config, resolution)
    if not resolution.wants_gpu:
        return _no_gpu(config, resolution, options)
    target, slices = resolution.target, resolution.slices
    refusal = check_assignment(resolution.claim, cards, unit, None, require_healthy=False)
    if refusal is not None:  # the resolver checked against the node's pods; this guards the lookups below
        return Outcome(refusal=refusal)

    wanted = tuple(s.uuid for s in slices)
    mismatch = _mismatch(config, wanted, target.uid)
    if mismatch is None:
        return Outcome()

    by_uuid = {c.uuid: c for c in cards}
    assigned_cards = [by_uuid[u] for u in wanted]
    fixed = cri_pb2.ContainerConfig()
    fixed.CopyFrom(config)
    with_env(fixed, assigned_env(slices, resolution.pod_mem, {c.uuid: unit.units_of(c.memory_mib) for c in cards}))
    fixed.annotations[CTR_ANN_POD_UID] = target.uid
    fixed.annotations[CTR_ANN_POD] = target.pod_key
    fixed.annotations[CTR_ANN_CONTAINER] = target.container
    fixed.annotations[CTR_ANN_CARDS] = ",".join(wanted)
    if options.rewrite_devices:
        with_devices(fixed, assigned_cards)
    if options.cdi:
        with_cdi(fixed, assigned_cards)
    reason, given = mismatch
    return Outcome(
        config=fixed,
        reason=reason,
        message=f"{target}: device plugin gave {given}; the scheduler assigned {describe(slices)} "
        f"({resolution.source}); corrected",
    )


def _mismatch(config: cri_pb2.ContainerConfig, wanted: tuple[str, ...], pod_uid: str) -> tuple[str, str] | None:
    """How what the device plugin injected differs from the assignment: a reason label and what it
    gave; None when it matches."""
    plugin = plugin_view(config)
    visible = sorted(set(env_values(config, ENV_VISIBLE_DEVICES)))
    if not plugin.cards:
        return "unserved", "no card"
    if plugin.cards != wanted:
        return "wrong-card", ", ".join(plugin.cards)
    if plugin.pod_uid and pod_uid and plugin.pod_uid != pod_uid:
        return "wrong-pod", f"{', '.join(plugin.cards)} but for pod uid {plugin.pod_uid}"
    if visible != [",".join(wanted)]:
        return "env-mismatch", f"{ENV_VISIBLE_DEVICES}={' | '.join(visible) or '(unset)'}"
    return None
