"""The Allocate decision: check the scheduler's assignment against this node, then build the answer.

Pure: takes the pods on the node and the node's cards, returns what to tell kubelet and what to record
on the pod, or raises :class:`~gpushare.assignment.Refusal`. Whoever wrote the annotations, nothing
here trusts them: the container's cards pass :func:`gpushare.assignment.check_extender_decision` first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.deviceplugin.devices import card_of_device
from gpushare.deviceplugin.matching import Skipped, fully_served, match_container

from gpushare.assignment import Claim, Holdings, Refusal, check_extender_decision, describe
from gpushare.cards import Card
from gpushare.contract.aliyun import format_bool, parse_bool
from gpushare.contract.allocation import CardSlice, format_assigned_containers, validate_allocation
from gpushare.contract.cardrule import parse_card_rule
from gpushare.contract.env import assigned_env, toolkit_memory_env
from gpushare.contract.errors import AnnotationError, ContractError
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_ASSIGNED_CONTAINERS,
    ANN_FRAMEWORK_ALLOCATION,
    ANN_MEM_ASSIGNED,
    ANN_MEM_IDX,
    CTR_ANN_CARDS,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD,
    CTR_ANN_POD_UID,
    ENV_CGPU_DISABLE,
    NODE_LABEL_CGPU_DISABLE,
    RESOURCE_COUNT,
)
from gpushare.contract.pending import Ledger
from gpushare.contract.units import MemoryUnit
from gpushare.holdings.node import node_usage
from gpushare.holdings.pod import pod_allocation
from gpushare.placement.demand import ANY_CARD, CardRule


@dataclass(frozen=True, slots=True)
class Decision:
    pod: Mapping[str, Any]
    container: str
    slices: tuple[CardSlice, ...]
    envs: dict[str, str]
    annotations: dict[str, str]
    #: the annotation patch recording this container as served
    pod_patch: dict[str, Any]
    #: units held per card UUID by the node's live pods, this container included
    usage: dict[str, int]
    #: pending pods passed over because they can't be read (each gets an Event)
    skipped: tuple[Skipped, ...] = ()


def decide(
    pods: Sequence[Mapping[str, Any]],
    node: str,
    resource: str,
    units: int,
    cards: Sequence[Card],
    unit: MemoryUnit,
    ledger: Ledger | None = None,
) -> Decision:
    """``ledger``: the node's, as last read (see :func:`gpushare.holdings.node.node_ledger`)."""
    try:
        match = match_container(pods, node, resource, units)
    except AnnotationError as exc:
        # the pod that would match carries a malformed annotation: name it
        raise Refusal("bad-annotation", f"{resource} x{units}: {exc}", invalid_input=True) from None
    except ContractError as exc:
        raise Refusal("bad-request", f"{resource} x{units}: {exc}", invalid_input=True) from None
    if match is None:
        raise Refusal(
            "no-pending-pod",
            f"{resource} x{units}: no pending pod on node {node} has an unserved container whose {resource} "
            f"limit is {units} (was it scheduled by the gpushare extender?)",
        )
    key, name = match.request.key, match.container.name
    try:
        allocation = pod_allocation(match.pod, cards)
        if allocation is None:
            raise ContractError(
                f"pod {key} has none of {ANN_ALLOCATION}, {ANN_FRAMEWORK_ALLOCATION} or {ANN_MEM_IDX}: no card assigned"
            )
        validate_allocation(match.request, allocation)
        rule = parse_card_rule(match.pod)
    except ContractError as exc:
        raise Refusal(
            "bad-annotation", f"pod {key} container {name}: {exc}", invalid_input=True, pod=match.pod
        ) from None
    slices = allocation[name]
    meta = match.pod.get("metadata") or {}
    usage, counted, _ = node_usage(pods, NodeInventory(unit, tuple(cards)), ledger=ledger)
    claim = Claim(key, meta.get("uid", ""), name, slices, exclusive=match.container.exclusive, rule=rule)
    refusal = check_extender_decision(claim, cards, unit, Holdings(usage, counted, ledger or {}))
    if refusal is not None:
        raise refusal.about(match.pod)

    served = {**match.served, name: match.served.get(name, frozenset()) | {resource}}
    annotations: dict[str, str] = {ANN_ASSIGNED_CONTAINERS: format_assigned_containers(served)}
    if fully_served(match.request, served):
        annotations[ANN_MEM_ASSIGNED] = format_bool(True)
    card_units = {c.uuid: unit.units_of(c.memory_mib) for c in cards}
    return Decision(
        pod=match.pod,
        container=name,
        slices=slices,
        envs=assigned_env(slices, match.request.effective_mem, card_units) | toolkit_memory_env(slices, unit.mib),
        annotations={
            CTR_ANN_POD_UID: meta.get("uid", ""),
            CTR_ANN_POD: key,
            CTR_ANN_CONTAINER: name,
            CTR_ANN_CARDS: ",".join(s.uuid for s in slices),
        },
        pod_patch={"metadata": {"annotations": annotations}},
        usage=usage,
        skipped=match.skipped,
    )


def node_env(labels: Mapping[str, str]) -> dict[str, str]:
    """Env every GPU container on the node gets from the node's labels: ``cgpu.disable.isolation=true``
    turns cGPU's memory isolation off (``CGPU_DISABLE=true``), as the original plugin does."""
    return {ENV_CGPU_DISABLE: "true"} if parse_bool(labels.get(NODE_LABEL_CGPU_DISABLE)) else {}


def booked_cards_note(resource: str, device_ids: Sequence[str], slices: Sequence[CardSlice]) -> str | None:
    """When kubelet booked gpu-count replicas of other cards than the container gets, what differs.

    The container always gets the scheduler's cards; kubelet's books only decide how many replicas
    it counts as free, and replicas never run short, so a difference is worth a log line only.
    """
    if resource != RESOURCE_COUNT:
        return None
    booked = sorted(card_of_device(d) for d in device_ids)
    assigned = sorted(s.uuid for s in slices)
    if booked == assigned:
        return None
    return f"kubelet booked {RESOURCE_COUNT} replicas of {', '.join(booked)}; the container gets {describe(slices)}"


def preferred_cards(
    pods: Sequence[Mapping[str, Any]], node: str, resource: str, size: int, cards: Sequence[Card]
) -> tuple[tuple[str, ...], CardRule]:
    """The card UUIDs the scheduler chose for the container the next Allocate would match, if any, and
    what that pod's annotations ask of its cards (any card when there is no such pod)."""
    try:
        match = match_container(pods, node, resource, size)
        if match is None:
            return (), ANY_CARD
        rule = parse_card_rule(match.pod)
        allocation = pod_allocation(match.pod, cards)
    except ContractError:
        return (), ANY_CARD
    if allocation is None or match.container.name not in allocation:
        return (), rule
    return tuple(s.uuid for s in allocation[match.container.name]), rule
