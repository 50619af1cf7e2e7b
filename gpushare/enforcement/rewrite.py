"""The decision about a container being created, pure: given what the node sees of it
(:class:`~gpushare.enforcement.container.ContainerRequest`), its resolved assignment and the node's
cards, say whether to forward it unchanged, forward it with :class:`~gpushare.enforcement.container.Edits`,
or refuse it.

The device plugin can't tell pods apart in Allocate, so what it injected (its annotations and env) may
belong to another pod. Whenever that differs from the assignment, every GPU-related part of the
container is rebuilt from the assignment: env, annotations and, when enabled, device nodes and CDI names.
A container whose cards come from DRA claims keeps its claims' CDI devices (the runtime applies them)
and gets the GPU env of all their cards set here: each claim's CDI spec could only name its own cards,
and the runtime would keep the last one's (see :func:`gpushare.holdings.dra.dra_env`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gpushare.assignment import Refusal, check_extender_decision, describe
from gpushare.cards import Card
from gpushare.contract.env import assigned_env, toolkit_memory_env
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
from gpushare.enforcement.container import ContainerRequest, Decision, Edits
from gpushare.enforcement.resolve import DRA_CLAIM, Resolution, plugin_view
from gpushare.settings import RewriteOptions

CARD_DEVICE = re.compile(r"^/dev/nvidia[0-9]+$")


def device_edits(request: ContainerRequest, cards: Sequence[Card]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(removed, added) device nodes: every per-card node goes, the ``cards``' nodes come, and the
    control devices every GPU container needs are added where missing."""
    old = tuple(path for path in request.devices if CARD_DEVICE.match(path))
    present = set(request.devices) - set(old)
    wanted = [device_file(c.minor) for c in cards] + [p for p in DEV_CONTROL_FILES if p not in present]
    return old, tuple(wanted)


def cdi_edits(request: ContainerRequest, cards: Sequence[Card]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(removed, added) CDI names: those of the per-card kind go, the ``cards``' come."""
    old = tuple(name for name in request.cdi_devices if name.startswith(f"{CDI_KIND}="))
    return old, tuple(cdi_device_name(c.uuid) for c in cards)


def _no_gpu(request: ContainerRequest, resolution: Resolution, options: RewriteOptions) -> Decision:
    """A container without a GPU request gets ``void``: whatever its spec or image says, the NVIDIA
    runtime then exposes no card to it."""
    if not options.block_unrequested_gpu:
        return Decision()
    current = request.env_values(ENV_VISIBLE_DEVICES)
    if current == [VISIBLE_DEVICES_VOID]:
        return Decision()
    fixed = Edits(env={ENV_VISIBLE_DEVICES: VISIBLE_DEVICES_VOID})
    if not current:
        return Decision(edits=fixed)
    return Decision(
        edits=fixed,
        reason="unrequested-gpu",
        message=f"{resolution.target}: requests no GPU but sets {ENV_VISIBLE_DEVICES}={','.join(current)}; "
        f"replaced with {VISIBLE_DEVICES_VOID}",
    )


def _dra(resolution: Resolution) -> Decision:
    """The env of every card the container's claims give it, in place of whatever its spec set for
    those variables."""
    if resolution.dra_env is None:  # never forwarded without the env of its cards
        return Decision(refusal=Refusal(DRA_CLAIM, f"{resolution.target}: its ResourceClaims' cards were not resolved"))
    return Decision(edits=Edits(env=dict(resolution.dra_env)))


def rewrite(
    request: ContainerRequest,
    resolution: Resolution,
    cards: Sequence[Card],
    unit: MemoryUnit,
    options: RewriteOptions,
) -> Decision:
    if resolution.refusal is not None:
        return Decision(refusal=resolution.refusal)
    if resolution.dra_devices:
        return _dra(resolution)
    if not resolution.wants_gpu:
        return _no_gpu(request, resolution, options)
    target, slices = resolution.target, resolution.slices
    refusal = check_extender_decision(resolution.claim, cards, unit, None, require_healthy=False)
    if refusal is not None:  # the resolver checked against the node's pods; this guards the lookups below
        return Decision(refusal=refusal)

    wanted = tuple(s.uuid for s in slices)
    memory = toolkit_memory_env(slices, unit.mib)
    mismatch = _mismatch(request, wanted, target.uid)
    if mismatch is None:
        if all(request.env_values(key) == [value] for key, value in memory.items()):
            return Decision()
        return Decision(edits=Edits(env=memory))  # a silent hardening: the device plugin doesn't set them

    by_uuid = {c.uuid: c for c in cards}
    assigned_cards = [by_uuid[u] for u in wanted]
    no_change: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    devices = device_edits(request, assigned_cards) if options.rewrite_devices else no_change
    cdi = cdi_edits(request, assigned_cards) if options.cdi else no_change
    fixed = Edits(
        env=assigned_env(slices, resolution.pod_mem, {c.uuid: unit.units_of(c.memory_mib) for c in cards}) | memory,
        annotations={
            CTR_ANN_POD_UID: target.uid,
            CTR_ANN_POD: target.pod_key,
            CTR_ANN_CONTAINER: target.container,
            CTR_ANN_CARDS: ",".join(wanted),
        },
        remove_devices=devices[0],
        add_devices=devices[1],
        remove_cdi=cdi[0],
        add_cdi=cdi[1],
    )
    reason, given = mismatch
    return Decision(
        edits=fixed,
        reason=reason,
        message=f"{target}: device plugin gave {given}; the scheduler assigned {describe(slices)} "
        f"({resolution.source}); corrected",
    )


def _mismatch(request: ContainerRequest, wanted: tuple[str, ...], pod_uid: str) -> tuple[str, str] | None:
    """How what the device plugin injected differs from the assignment: a reason label and what it
    gave; None when it matches."""
    plugin = plugin_view(request)
    visible = sorted(set(request.env_values(ENV_VISIBLE_DEVICES)))
    if not plugin.cards:
        return "unserved", "no card"
    if plugin.cards != wanted:
        return "wrong-card", ", ".join(plugin.cards)
    if plugin.pod_uid and pod_uid and plugin.pod_uid != pod_uid:
        return "wrong-pod", f"{', '.join(plugin.cards)} but for pod uid {plugin.pod_uid}"
    if visible != [",".join(wanted)]:
        return "env-mismatch", f"{ENV_VISIBLE_DEVICES}={' | '.join(visible) or '(unset)'}"
    return None
