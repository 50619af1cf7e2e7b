"""Which cards a container being created (:class:`~gpushare.enforcement.container.ContainerRequest`)
must get: read from the pod annotations kubelet passes for its sandbox, or, when those are missing or
stale, from the pod itself through the API server.
A container kubelet gave CDI devices of prepared DRA claims (kind ``gpu.gpushare.io/claim``) gets its
cards from those claims instead: the env of every card they name (:func:`gpushare.holdings.dra.dra_env`), read
from the pod's claims, each of which must be reserved for the pod.

The pure part (:func:`plugin_view`, :func:`from_annotations`, :func:`from_pod`,
:func:`from_dra`) works on plain values. :class:`Resolver` adds the node's pod cache: the API
fallback, the over-commit check against every live pod on the node, and what a pod holds (its memory
limits), ResourceClaims included.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpushare.assignment import Claim, Holdings, Refusal, check_extender_decision
from gpushare.cards import Card
from gpushare.contract.aliyun import parse_card_index
from gpushare.contract.allocation import CardSlice, parse_allocation
from gpushare.contract.cardrule import card_rule_of, parse_card_rule
from gpushare.contract.dra import claim_cdi_devices
from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_FRAMEWORK_ALLOCATION,
    ANN_MEM_IDX,
    CTR_ANN_CARDS,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD_UID,
    ENV_MEM_CONTAINER,
    ENV_MEM_POD,
    ENV_VISIBLE_DEVICES,
    RESOURCES,
)
from gpushare.contract.pending import Ledger
from gpushare.contract.request import parse_pod_request
from gpushare.contract.resourceclaim import ClaimError
from gpushare.contract.units import MemoryUnit
from gpushare.enforcement.container import ContainerRequest, Target
from gpushare.holdings.dra import dra_env, dra_held, pod_claim_names
from gpushare.holdings.node import node_ledger, node_usage
from gpushare.holdings.pod import card_by_minor, pod_allocation, pod_cards
from gpushare.kube.errors import KubeError, KubeNotFound
from gpushare.kube.objects import get_node, get_pod, get_resource_claim
from gpushare.placement.demand import ANY_CARD, CardRule

log = logging.getLogger(__name__)

SOURCE_ANNOTATIONS = "pod annotations"
SOURCE_API = "API server"
SOURCE_DRA = "ResourceClaims"
#: the refusal reason of a container given cards both through DRA claims and the device plugin
DRA_AND_DEVICE_PLUGIN = "dra-and-device-plugin"
#: the refusal reason of a container whose CDI devices or ResourceClaims can't give it cards
DRA_CLAIM = "dra-claim"


@dataclass(frozen=True, slots=True)
class PluginView:
    """What the device plugin's Allocate answer put into the container.

    ``served``: our plugin's container annotations are there. Kubelet fills container annotations
    only from device plugins (a pod spec can't set them), so this is proof that kubelet gave the
    container a gpushare device. ``env_only``: there is just the original plugin's env, which a pod
    spec can set as well; whether such a container really requested a GPU is asked of the API.
    """

    served: bool
    cards: tuple[str, ...]
    pod_uid: str
    units: int | None
    env_only: bool = False
    #: the plugin's ALIYUN_COM_GPU_MEM_POD (the pod's effective gpu-mem), when it gave one
    pod_mem: int | None = None


@dataclass(frozen=True, slots=True)
class Resolution:
    """What a container being created resolves to: no GPU, these cards, or a refusal (placement's
    :class:`gpushare.placement.Assignment` is the scheduler's choice; this is the node's reading of it)."""

    target: Target
    wants_gpu: bool
    slices: tuple[CardSlice, ...] = ()
    pod_mem: int = 0
    source: str = SOURCE_ANNOTATIONS
    refusal: Refusal | None = None
    #: what the pod's annotations ask of its cards
    rule: CardRule = ANY_CARD
    #: what the pod holds per card UUID, as the over-commit check counted it (None: not counted)
    pod_held: Mapping[str, int] | None = None
    #: the CDI devices of DRA claims kubelet gave the container (its cards come from them, not ``slices``)
    dra_devices: tuple[str, ...] = ()
    #: the GPU env of the cards those claims give the container (:func:`gpushare.holdings.dra.dra_env`)
    dra_env: Mapping[str, str] | None = None
    #: the pod's ResourceClaims by name as read for that env, which its memory limits count too: one
    #: read of each per container, and the env and the limits from the same claims
    dra_claims: Mapping[str, dict[str, Any]] | None = None

    @property
    def claim(self) -> Claim:
        return self.target.claim(self.slices, self.rule)


def refuse(target: Target, reason: str, why: str) -> Resolution:
    return Resolution(target=target, wants_gpu=True, refusal=Refusal(reason, f"{target}: {why}"))


def _split(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def plugin_view(request: ContainerRequest) -> PluginView:
    """Our device plugin marks the containers it served with annotations; the original plugin leaves
    only its env (see :class:`PluginView` for how far each is trusted). A repeated env key counts by its
    last value."""
    env = dict(request.env)
    annotations = request.annotations
    units, pod_mem = (_int_or(env.get(key), None) for key in (ENV_MEM_CONTAINER, ENV_MEM_POD))
    served = CTR_ANN_CARDS in annotations or CTR_ANN_CONTAINER in annotations
    env_only = not served and units is not None
    cards = _split(annotations.get(CTR_ANN_CARDS, "")) or (
        _split(env.get(ENV_VISIBLE_DEVICES, "")) if served or env_only else ()
    )
    return PluginView(
        served=served,
        cards=cards,
        pod_uid=annotations.get(CTR_ANN_POD_UID, ""),
        units=units,
        env_only=env_only,
        pod_mem=pod_mem,
    )


def from_annotations(
    target: Target, annotations: Mapping[str, str], plugin: PluginView, cards: Sequence[Card]
) -> Resolution | None:
    """The assignment recorded in the sandbox's pod annotations; None when they don't settle it (no
    assignment for a container the plugin served, unreadable or naming a card this node lacks, or
    only env that the pod spec may have set itself).

    Pod annotations never make a container a GPU container: their owner can write them. Only a
    container kubelet served a gpushare device to gets cards; any other gets none.
    """
    if plugin.env_only:
        return None
    if not plugin.served:
        return Resolution(target=target, wants_gpu=False)
    if ANN_ALLOCATION in annotations:
        try:
            allocation = parse_allocation(annotations[ANN_ALLOCATION], target.pod_key)
        except ContractError:
            return None
        slices = allocation.get(target.container)
        if slices is None:
            return None
    elif ANN_MEM_IDX in annotations and ANN_FRAMEWORK_ALLOCATION not in annotations:
        # placed by the original extender alone: one card, named by its /dev/nvidia minor
        if plugin.units is None:
            return None
        try:
            number = parse_card_index(annotations[ANN_MEM_IDX], target.pod_key)
            card = card_by_minor(cards, number, target.pod_key, f"annotation {ANN_MEM_IDX}")
        except ContractError:
            return None
        slices = (CardSlice(index=card.index, uuid=card.uuid, units=plugin.units),)
    else:
        return None  # the framework annotation needs the pod spec (container positions): ask the API
    known = {c.uuid for c in cards}
    if any(s.uuid not in known for s in slices):
        return None
    try:
        rule = card_rule_of(annotations, target.pod_key)
    except ContractError:
        return None
    return Resolution(
        target=target,
        wants_gpu=True,
        slices=slices,
        pod_mem=plugin.pod_mem if plugin.pod_mem is not None else sum(s.units for s in slices),
        source=SOURCE_ANNOTATIONS,
        rule=rule,
    )


def _int_or(text: str | None, default: int | None) -> int | None:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def from_dra(target: Target, devices: tuple[str, ...], plugin: PluginView, requests_plugin_gpu: bool) -> Resolution:
    """A container kubelet gave CDI ``devices`` of prepared DRA claims gets the claims' cards (the
    runtime applies their CDI edits), unless the device plugin serves it too (``plugin``) or its spec
    asks the device plugin for a GPU (``requests_plugin_gpu``): a container gets its GPU one way."""
    if plugin.served or requests_plugin_gpu:
        return refuse(
            target,
            DRA_AND_DEVICE_PLUGIN,
            f"gets GPUs both through ResourceClaims (CDI device(s) {', '.join(devices)}) and through the device "
            f"plugin ({' or '.join(RESOURCES)}); a container gets its GPU one way: drop its claim or its "
            "gpushare resource request",
        )
    return Resolution(target=target, wants_gpu=True, source=SOURCE_DRA, dra_devices=devices)


def from_pod(target: Target, pod: Mapping[str, Any], cards: Sequence[Card]) -> Resolution:
    """The assignment from the pod object itself: its spec says whether the container wants a GPU."""
    try:
        request = parse_pod_request(pod)
        container = request.container(target.container)
        if container is None:
            return refuse(target, "bad-annotation", "the pod from the API server has no such container")
        if not container.wants_gpu:
            return Resolution(target=target, wants_gpu=False, source=SOURCE_API)
        allocation = pod_allocation(pod, cards)
        rule = parse_card_rule(pod)
    except ContractError as exc:
        return refuse(target, "bad-annotation", str(exc))
    if not allocation or target.container not in allocation:
        return refuse(target, "no-assignment", f"requests a GPU but the pod has no card assignment ({ANN_ALLOCATION})")
    return Resolution(
        target=target,
        wants_gpu=True,
        slices=allocation[target.container],
        pod_mem=request.effective_mem,
        source=SOURCE_API,
        rule=rule,
    )


class PodLookup(Protocol):
    """The node's pods as the API server knows them."""

    @property
    def node(self) -> str:
        """The node's name: the pool of its cards in ResourceClaims' allocations."""

    def resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The ResourceClaim; raises KubeError (naming it) when it can't be read or doesn't exist."""

    def pod(self, namespace: str, name: str, uid: str) -> Mapping[str, Any] | None:
        """The pod with this uid (any uid when empty), or None when there is none; raises KubeError when
        the API server can't be asked."""

    def node_pods(self) -> Sequence[Mapping[str, Any]] | None:
        """Every pod bound to this node (as last synced, while the API server is away), or None when
        that list has never been known."""

    def ledger(self) -> Ledger:
        """The node's ledger (see :mod:`gpushare.holdings.node`): as it is now, else as last read."""


class Resolver:
    """Resolve a container's assignment, asking the API only when allowed and needed."""

    def __init__(self, unit: MemoryUnit, pods: PodLookup | None) -> None:
        self._unit = unit
        self._pods = pods

    def resolve(self, request: ContainerRequest, cards: Sequence[Card]) -> Resolution:
        target = request.target
        plugin = plugin_view(request)
        devices = claim_cdi_devices(request.cdi_devices, request.annotations)
        if devices:
            return self._resolve_dra(target, devices, plugin, cards)
        found = from_annotations(target, request.sandbox_annotations, plugin, cards)
        if found is None:
            pod = self._api_pod(target, "no card assignment in sandbox_config")
            if isinstance(pod, Resolution):
                return pod
            found = from_pod(target, pod, cards)
        if found.refusal is None and found.wants_gpu:
            return self._check_capacity(found, cards)
        return found

    def _api_pod(self, target: Target, missing: str) -> Mapping[str, Any] | Resolution:
        """The pod from the API server, asked because of what is ``missing``; else the refusal."""
        if self._pods is None:
            return refuse(target, "no-assignment", f"{missing}, and API lookups are disabled (--no-api-fetch)")
        try:
            pod = self._pods.pod(target.namespace, target.pod, target.uid)
        except KubeError as exc:
            return refuse(target, "api-unavailable", f"{missing} and {exc}")
        if pod is None:
            return refuse(target, "no-assignment", f"{missing} and the pod is gone")
        return pod

    def _resolve_dra(
        self, target: Target, devices: tuple[str, ...], plugin: PluginView, cards: Sequence[Card]
    ) -> Resolution:
        """A container with CDI devices of DRA claims gets the env of every card they give it, read from
        the pod's claims (:func:`gpushare.holdings.dra.dra_env`): a device that names no claim reserved for the
        pod, or a claim another pod holds, refuses it. Only the device plugin's env, which a pod spec can
        set as well, needs the pod's spec to say whether it also asks the device plugin for a GPU."""
        listed = ", ".join(devices)
        if plugin.env_only:
            why = (
                f"has CDI device(s) {listed} of ResourceClaims and the device plugin's env {ENV_MEM_CONTAINER}, "
                "which only its pod spec can explain"
            )
        else:
            found = from_dra(target, devices, plugin, requests_plugin_gpu=False)
            if found.refusal is not None:
                return found
            why = f"needs its pod's ResourceClaims for CDI device(s) {listed}"
        pod = self._api_pod(target, why)
        if isinstance(pod, Resolution):
            return pod
        if plugin.env_only:
            try:
                container = parse_pod_request(pod).container(target.container)
            except ContractError as exc:
                return refuse(target, "bad-annotation", str(exc))
            if container is None:
                return refuse(target, "bad-annotation", "the pod from the API server has no such container")
            found = from_dra(target, devices, plugin, requests_plugin_gpu=container.wants_gpu)
            if found.refusal is not None:
                return found
        assert self._pods is not None  # _api_pod refused otherwise
        try:
            claims = self._claims(pod)
            env = dra_env(pod, claims, devices, self._pods.node, NodeInventory(self._unit, tuple(cards)))
        except ClaimError as exc:
            return refuse(target, DRA_CLAIM, str(exc))
        return replace(found, dra_env=env, dra_claims=claims)

    def _claims(self, pod: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The pod's ResourceClaims by name (:func:`gpushare.holdings.dra.pod_claim_names`); ClaimError when one
        can't be read."""
        assert self._pods is not None
        namespace = (pod.get("metadata") or {}).get("namespace", "default")
        claims = {}
        for name in pod_claim_names(pod):
            try:
                claims[name] = self._pods.resource_claim(namespace, name)
            except KubeError as exc:
                raise ClaimError(str(exc)) from None
        return claims

    def pod_held(self, found: Resolution, annotations: Mapping[str, str], cards: Sequence[Card]) -> dict[str, int]:
        """Units ``found``'s pod holds per card UUID, which its memory limits are: what it holds through
        the device plugin plus what its ResourceClaims were allocated on this node's cards
        (:func:`gpushare.holdings.dra.dra_held`).

        Through the device plugin: by the node's rule (:func:`gpushare.holdings.pod.pod_cards`, the node's
        ledger first), as the over-commit check counted it or else from the pod when it can be had;
        else (API lookups off or failing) the pod's allocation annotation summed per card, which is at
        least what it holds. Never less than the container's own cards.

        ClaimError (naming the claim or the pod's field at fault) when the pod's claims can't be read
        or counted; for a container with DRA devices also when the pod can't be read: its limits are
        never guessed."""
        target = found.target
        pod: Mapping[str, Any] | None = None
        problem: KubeError | None = None
        if self._pods is not None:
            try:
                pod = self._pods.pod(target.namespace, target.pod, target.uid)
            except KubeError as exc:
                problem = exc
        inventory = NodeInventory(self._unit, tuple(cards))
        held = dict(found.pod_held or {})
        if not held and pod is not None:
            counted, _ = pod_cards(pod, inventory, self._pods.ledger().get(target.uid))
            held = dict(counted.held) if counted is not None else {}
        if not held and problem is not None and not found.dra_devices:
            log.warning("%s: %s; its memory limits are taken from its annotations", target, problem)
        if not held:
            try:
                allocation = parse_allocation(annotations.get(ANN_ALLOCATION, "{}"), target.pod_key)
            except ContractError:
                allocation = {}
            for slices in allocation.values():
                for part in slices:
                    held[part.uuid] = held.get(part.uuid, 0) + part.units
        for part in found.slices:
            held[part.uuid] = max(held.get(part.uuid, 0), part.units)
        for uuid, units in self._dra_held(found, pod, problem, inventory).items():
            held[uuid] = held.get(uuid, 0) + units
        return held

    def _dra_held(
        self, found: Resolution, pod: Mapping[str, Any] | None, problem: KubeError | None, inventory: NodeInventory
    ) -> dict[str, int]:
        """What the pod holds through its ResourceClaims on ``inventory``'s cards; see :meth:`pod_held`."""
        devices = ", ".join(found.dra_devices)
        if self._pods is None or pod is None:
            if not found.dra_devices:
                return {}
            why = "API lookups are disabled (--no-api-fetch)" if self._pods is None else problem or "the pod is gone"
            raise ClaimError(f"its ResourceClaims (CDI device(s) {devices}) can't be read: {why}")
        claims = found.dra_claims if found.dra_claims is not None else self._claims(pod)
        return dra_held(pod, claims, self._pods.node, inventory)

    def _check_capacity(self, found: Resolution, cards: Sequence[Card]) -> Resolution:
        if self._pods is None:  # --no-api-fetch: the operator chose to trust sandbox_config alone
            return found
        pods = self._pods.node_pods()
        if pods is None:
            return refuse(
                found.target,
                "api-unavailable",
                "the node's pods have not been listed from the API server yet, so the cards can't be "
                "checked for over-commit",
            )
        ledger = self._pods.ledger()
        used, counted, _ = node_usage(pods, NodeInventory(self._unit, tuple(cards)), ledger=ledger)
        holdings = Holdings(used, counted, ledger)
        refusal = check_extender_decision(found.claim, cards, self._unit, holdings, require_healthy=False)
        return replace(found, refusal=refusal, pod_held=holdings.held_by(found.claim))


class CachedPods:
    """A :class:`PodLookup` over the node's watch cache, falling back to a direct GET while the cache
    hasn't synced or doesn't hold the pod yet (kubelet can be faster than our watch). The node's ledger
    is read from the node on each ask, while the cache is connected; else the last one read serves."""

    def __init__(self, api: Any, cache: Any, node: str) -> None:
        self._api = api
        self._cache = cache
        self._node = node
        self._ledger: Ledger = {}

    @property
    def node(self) -> str:
        return self._node

    def resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return get_resource_claim(self._api, namespace, name)

    def pod(self, namespace: str, name: str, uid: str) -> Mapping[str, Any] | None:
        cached = self._cache.get(name, namespace) if self._cache.synced else None
        if cached is not None and _uid_matches(cached, uid):
            return cached
        try:
            pod = get_pod(self._api, namespace, name)
        except KubeNotFound:
            return None
        return pod if _uid_matches(pod, uid) else None

    def node_pods(self) -> Sequence[Mapping[str, Any]] | None:
        return self._cache.items() if self._cache.synced else None

    def ledger(self) -> Ledger:
        if not self._cache.connected:
            return self._ledger
        try:
            self._ledger = node_ledger(get_node(self._api, self._node))
        except KubeError as exc:
            log.warning("node %s: reading its ledger failed, using the one last read: %s", self._node, exc)
        except ContractError as exc:
            log.error("%s; pods are checked against the ledger last read (%d entries)", exc, len(self._ledger))
        return self._ledger


def _uid_matches(pod: Mapping[str, Any], uid: str) -> bool:
    return not uid or (pod.get("metadata") or {}).get("uid") == uid
