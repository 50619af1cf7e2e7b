"""What a pod holds through ResourceClaims of the DRA driver ``gpu.gpushare.io``, and the env they give.

On each card, a pod holds the sum over its claims of what they were allocated there
(``consumedCapacity.memory``, in the node's memory unit; :func:`dra_held`). Tenants can't forge those:
the scheduler writes a claim's allocation and reservation, so they are read from the claims, never
from the pod. A claim serves one pod at a time (:func:`_pod_claim` says why), and a container using
claims sees all their cards (:func:`dra_env`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpushare.contract.allocation import CardSlice
from gpushare.contract.dra import parse_claim_cdi_device
from gpushare.contract.env import assigned_env
from gpushare.contract.errors import quoted
from gpushare.contract.inventory import NodeInventory
from gpushare.contract.request import pod_key
from gpushare.contract.resourceclaim import ClaimAllocation, ClaimError, ClaimRef, card_slices, node_shares


def _claim_name(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ClaimError(f"{where}: {quoted(value)} is not a ResourceClaim name")
    return value


def pod_claim_names(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """The ResourceClaims the pod uses, by name (in its namespace), each once, as kubelet finds them:
    a ``spec.resourceClaims`` entry's ``resourceClaimName``, or for one made from a template the name
    its ``status.resourceClaimStatuses`` entry gives (an entry without a name needed no claim); and the
    claim the scheduler made for extended resources (``status.extendedResourceClaimStatus``).
    ClaimError (naming the pod and field) when a template's claim isn't named in the status yet."""
    key = pod_key(pod)
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    made = {entry.get("name"): entry for entry in status.get("resourceClaimStatuses") or [] if isinstance(entry, dict)}
    names = []
    for i, entry in enumerate(spec.get("resourceClaims") or []):
        where = f"pod {key} spec.resourceClaims[{i}]"
        if not isinstance(entry, dict):
            raise ClaimError(f"{where}: {quoted(entry)} is not an object")
        name = _claim_name(entry.get("resourceClaimName"), f"{where}.resourceClaimName")
        if name is None:
            generated = made.get(entry.get("name"))
            if generated is None:
                raise ClaimError(
                    f"{where} ({quoted(entry.get('name'))}): status.resourceClaimStatuses names no ResourceClaim "
                    "made for it yet"
                )
            name = _claim_name(generated.get("resourceClaimName"), f"pod {key} status.resourceClaimStatuses")
        if name is not None:
            names.append(name)
    extended = _claim_name(
        (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName"),
        f"pod {key} status.extendedResourceClaimStatus.resourceClaimName",
    )
    if extended is not None:
        names.append(extended)
    return tuple(dict.fromkeys(names))


def _reserved_pods(claim: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    return [r for r in reserved if isinstance(r, dict) and r.get("resource", "pods") == "pods"]


def _pod_claim(claim: Mapping[str, Any], namespace: str, name: str, pod: str, uid: str) -> ClaimRef:
    """The claim's reference, once it is known to be this pod's to hold: reserved for it, and for no pod
    before it.

    A claim's memory is one budget, however many containers or pods use it: each pod's cgroup is
    limited on its own (:mod:`gpushare.memlimits`), so two pods each given a shared claim's whole
    allocation could fill its card past its memory, and a division between them would change the
    limits of running pods whenever one joins or leaves. So the claim serves one pod at a time: the
    first pod in ``status.reservedFor`` (kube-scheduler appends each pod it binds, in PreBind, and the
    resourceclaim controller drops finished pods keeping the others' order: kubernetes v1.37.2
    ``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`` and
    ``pkg/controller/resourceclaim/controller.go``); a later pod is refused, naming the pod it waits
    for, and its containers are created once that pod is done. The containers of one pod share its
    claims freely: they are limited together, in the pod's cgroup."""
    ref = ClaimRef(namespace, name, str((claim.get("metadata") or {}).get("uid", "")))
    pods = _reserved_pods(claim)
    if not any(r.get("uid") == uid for r in pods):
        raise ClaimError(f"ResourceClaim {ref}: status.reservedFor does not name pod {pod} (uid {uid})")
    holder = pods[0]
    if holder.get("uid") != uid:
        raise ClaimError(
            f"ResourceClaim {ref} is in use by pod {namespace}/{holder.get('name', '?')} (uid {holder.get('uid')}) "
            f"as well as pod {pod}: a claim's GPU memory is one budget, used by one pod at a time; pod {pod} "
            "waits until that pod is done (or give each pod its own claim, e.g. from a ResourceClaimTemplate)"
        )
    return ref


def _pod_claims(
    pod: Mapping[str, Any], claims: Mapping[str, dict[str, Any]], node: str, inventory: NodeInventory
) -> dict[str, tuple[ClaimRef, dict[str, tuple[CardSlice, ...]]]]:
    """Each of the pod's claims by UID: its reference and its card slices on ``node`` by request."""
    meta = pod.get("metadata") or {}
    namespace, uid = meta.get("namespace", "default"), meta.get("uid", "")
    result = {}
    for name, claim in claims.items():
        ref = _pod_claim(claim, namespace, name, pod_key(pod), uid)
        allocation = ClaimAllocation(ref, node, node_shares(claim, f"ResourceClaim {ref}", node))
        result[ref.uid] = (ref, card_slices(allocation, inventory.cards, inventory.unit.mib))
    return result


def dra_held(
    pod: Mapping[str, Any], claims: Mapping[str, dict[str, Any]], node: str, inventory: NodeInventory
) -> dict[str, int]:
    """Units the pod holds per card UUID through its ResourceClaims ``claims`` (name -> the claim as
    the API server returns it; :func:`pod_claim_names` says which): on each card, the sum of their
    allocation results of driver ``gpu.gpushare.io`` in pool ``node`` (a claim of other drivers adds
    nothing). Each claim must be the pod's to hold (reserved for it and for no pod before it; see
    :func:`_pod_claim`). ClaimError (naming the claim and field) when one can't be counted: a result
    naming a card the node lacks, or not a whole number of units."""
    held: dict[str, int] = {}
    for _, by_request in _pod_claims(pod, claims, node, inventory).values():
        for slices in by_request.values():
            for part in slices:
                held[part.uuid] = held.get(part.uuid, 0) + part.units
    return held


def dra_env(
    pod: Mapping[str, Any],
    claims: Mapping[str, dict[str, Any]],
    devices: Sequence[str],
    node: str,
    inventory: NodeInventory,
) -> dict[str, str]:
    """The GPU env of a container kubelet gave the claims' CDI ``devices``: every card of every request
    they name, once each, in the order of the pod's claims and their allocation results (kubelet's
    order of the devices varies), with the units summed per card, as
    :func:`gpushare.contract.env.assigned_env` writes them (``ALIYUN_COM_GPU_MEM_POD``: what the pod
    holds through all its claims here).

    One rule for every container, whatever the number of its claims: the runtime applies CDI env edits
    over the container's own env, the last device's value winning (containerd v2.2
    ``internal/cri/opts/spec_linux.go`` ``WithCDI`` runs after ``oci.WithEnv`` of the CRI config, and
    tags.cncf.io/container-device-interface v1.1.0 ``Cache.InjectDevices`` appends every device's env
    and applies it with runtime-tools' ``AddMultipleProcessEnv``, which replaces a key already set). So
    the claims' CDI specs set none of these variables and the CRI shim sets them in the container's
    config. ClaimError when a device names no claim of the pod (reserved for it) or no request of one
    allocated on ``node``, or when a claim can't be counted (:func:`dra_held`)."""
    by_uid = _pod_claims(pod, claims, node, inventory)
    given: set[tuple[str, str]] = set()
    for device in devices:
        parsed = parse_claim_cdi_device(device, by_uid)
        if parsed is None:
            named = ", ".join(str(ref) for ref, _ in by_uid.values()) or "none"
            raise ClaimError(f"CDI device {device} names no ResourceClaim of pod {pod_key(pod)} (its claims: {named})")
        ref, by_request = by_uid[parsed[0]]
        if parsed[1] not in by_request:
            raise ClaimError(
                f"CDI device {device}: ResourceClaim {ref} has no request {parsed[1]} allocated a card of node {node}"
            )
        given.add(parsed)
    merged: dict[str, CardSlice] = {}
    for uid, (_, by_request) in by_uid.items():  # the pod's order, not kubelet's order of the devices
        for request, slices in by_request.items():
            for part in slices if (uid, request) in given else ():
                before = merged.get(part.uuid)
                merged[part.uuid] = replace(part, units=part.units + (before.units if before else 0))
    pod_units = sum(p.units for _, by_request in by_uid.values() for ss in by_request.values() for p in ss)
    return assigned_env(tuple(merged.values()), pod_units, {c.uuid: inventory.units_of(c) for c in inventory.cards})
