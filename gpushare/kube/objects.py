"""Reading and writing pods, nodes and bindings. Writes are JSON merge patches, optionally made
conditional on a resourceVersion, and retried through conflicts and outages otherwise."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypedDict, Unpack

from kubernetes import client

from gpushare.kube.errors import KubeCacheBehind
from gpushare.kube.retry import DEFAULT_BACKOFF, Backoff, retrying
from gpushare.kube.transport import call


def list_pods(
    api: client.ApiClient,
    *,
    field_selector: str | None = None,
    label_selector: str | None = None,
    resource_version: str | None = None,
) -> list[dict[str, Any]]:
    """With ``resource_version`` (non-zero) the API server answers from its watch cache, once that cache
    is at least that recent, instead of reading every pod from etcd. The pod cache moves only on pod
    events, so a version taken from another object (a node written last) can be one it never reaches:
    then the list is read from etcd, which is at least as recent."""
    kwargs = {
        k: v
        for k, v in (
            ("field_selector", field_selector),
            ("label_selector", label_selector),
            ("resource_version", resource_version),
        )
        if v
    }
    try:
        reply = call("list pods", client.CoreV1Api(api).list_pod_for_all_namespaces, **kwargs)
    except KubeCacheBehind:
        del kwargs["resource_version"]
        reply = call("list pods", client.CoreV1Api(api).list_pod_for_all_namespaces, **kwargs)
    return reply.get("items") or []


def list_nodes(api: client.ApiClient) -> list[dict[str, Any]]:
    return call("list nodes", client.CoreV1Api(api).list_node).get("items") or []


def get_pod(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return call(f"pod {namespace}/{name}", client.CoreV1Api(api).read_namespaced_pod, name, namespace)


def get_node(api: client.ApiClient, name: str) -> dict[str, Any]:
    return call(f"node {name}", client.CoreV1Api(api).read_node, name)


def get_resource_claim(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return call(
        f"ResourceClaim {namespace}/{name}", client.ResourceV1Api(api).read_namespaced_resource_claim, name, namespace
    )


def list_resource_slices(api: client.ApiClient, field_selector: str) -> list[dict[str, Any]]:
    """The ResourceSlices (resource.k8s.io/v1) ``field_selector`` picks (``spec.driver``, ``spec.nodeName``)."""
    reply = call("list ResourceSlices", client.ResourceV1Api(api).list_resource_slice, field_selector=field_selector)
    return reply.get("items") or []


def list_resource_claims(api: client.ApiClient) -> list[dict[str, Any]]:
    """Every ResourceClaim (resource.k8s.io/v1) of every namespace."""
    reply = call("list ResourceClaims", client.ResourceV1Api(api).list_resource_claim_for_all_namespaces)
    return reply.get("items") or []


MERGE_PATCH = "application/merge-patch+json"


def _with_precondition(patch: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
    if resource_version is None:
        return patch
    meta = {**(patch.get("metadata") or {}), "resourceVersion": resource_version}
    return {**patch, "metadata": meta}


class PatchOptions(TypedDict, total=False):
    """How a patch is written. With ``resource_version`` it only applies to that version (a stale one
    raises :class:`~gpushare.kube.errors.KubeConflict` at once); without it conflicts are retried.
    Outages are retried either way, ``retries`` times (default 5) after ``backoff``."""

    resource_version: str | None
    retries: int
    backoff: Backoff


def _merge_patch(
    what: str,
    send: Callable[..., Any],
    patch: dict[str, Any],
    *,
    resource_version: str | None = None,
    retries: int = 5,
    backoff: Backoff = DEFAULT_BACKOFF,
) -> dict[str, Any]:
    body = _with_precondition(patch, resource_version)
    return retrying(
        what,
        lambda: call(what, send, body=body, _content_type=MERGE_PATCH),
        retries,
        backoff,
        retry_conflicts=resource_version is None,
    )


def patch_pod(
    api: client.ApiClient, namespace: str, name: str, patch: dict[str, Any], **options: Unpack[PatchOptions]
) -> dict[str, Any]:
    """JSON-merge-patch a pod (see :class:`PatchOptions`)."""
    send = functools.partial(client.CoreV1Api(api).patch_namespaced_pod, name, namespace)
    return _merge_patch(f"pod {namespace}/{name}", send, patch, **options)


def patch_pod_status(api: client.ApiClient, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    """Merge-patch the pod's status subresource (what kubelet reports)."""
    send = functools.partial(client.CoreV1Api(api).patch_namespaced_pod_status, name, namespace)
    return _merge_patch(f"pod {namespace}/{name} status", send, {"status": status})


def patch_pod_annotations(
    api: client.ApiClient,
    namespace: str,
    name: str,
    annotations: dict[str, str | None],
    **options: Unpack[PatchOptions],
) -> dict[str, Any]:
    """Set annotations; a value of None removes the key."""
    return patch_pod(api, namespace, name, {"metadata": {"annotations": annotations}}, **options)


def patch_node(
    api: client.ApiClient, name: str, patch: dict[str, Any], **options: Unpack[PatchOptions]
) -> dict[str, Any]:
    """JSON-merge-patch a node (see :class:`PatchOptions`)."""
    send = functools.partial(client.CoreV1Api(api).patch_node, name)
    return _merge_patch(f"node {name}", send, patch, **options)


def bind_pod(
    api: client.ApiClient,
    namespace: str,
    name: str,
    uid: str | None,
    node: str,
    annotations: dict[str, str] | None = None,
) -> None:
    """Bind the pod to ``node``; the API server also sets ``annotations`` on the pod, in the same write."""
    body = client.V1Binding(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace, uid=uid, annotations=annotations),
        target=client.V1ObjectReference(kind="Node", name=node, api_version="v1"),
    )
    call(
        f"binding of pod {namespace}/{name} to node {node}",
        client.CoreV1Api(api).create_namespaced_pod_binding,
        name,
        namespace,
        body,
    )
