"""Where the CRI shim meets the transport-neutral decision (:mod:`gpushare.enforcement`): a
CreateContainer request read as a :class:`ContainerRequest`, a container about to start read the same way
from what the runtime says of it and of its sandbox, and a decision's :class:`Edits` written into a copy
of its ContainerConfig."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.json_format import ParseDict, ParseError

from gpushare.contract.names import (
    CRI_LABEL_CONTAINER_NAME,
    CRI_LABEL_POD_NAME,
    CRI_LABEL_POD_NAMESPACE,
    CRI_LABEL_POD_UID,
)
from gpushare.enforcement.container import ContainerRequest, Edits, Target
from gpushare.pb import cri_pb2

#: the permissions of an added device node when the container had no card node to copy them from
DEFAULT_DEVICE_PERMISSIONS = "rw"


def container_of(request: cri_pb2.CreateContainerRequest) -> ContainerRequest:
    """Kubelet names the pod in the sandbox metadata and labels, the container in its metadata."""
    sandbox, config = request.sandbox_config, request.config
    labels = sandbox.labels
    target = Target(
        namespace=sandbox.metadata.namespace or labels.get(CRI_LABEL_POD_NAMESPACE, ""),
        pod=sandbox.metadata.name or labels.get(CRI_LABEL_POD_NAME, ""),
        uid=sandbox.metadata.uid or labels.get(CRI_LABEL_POD_UID, ""),
        container=config.metadata.name or config.labels.get(CRI_LABEL_CONTAINER_NAME, ""),
    )
    return ContainerRequest(
        target=target,
        sandbox_annotations=dict(sandbox.annotations),
        env=tuple((kv.key, kv.value) for kv in config.envs),
        annotations=dict(config.annotations),
        devices=tuple(dict.fromkeys(path for d in config.devices for path in (d.host_path, d.container_path) if path)),
        cdi_devices=tuple(d.name for d in config.CDI_devices),
        cgroup_parent=sandbox.linux.cgroup_parent,
    )


class StatusError(ValueError):
    """The runtime's verbose status of a container doesn't say what the shim needs to know of it."""


def cgroup_parent(sandbox_info: str) -> str:
    """The pod's cgroup as kubelet gave it to the sandbox, from containerd's verbose sandbox status."""
    try:
        config = json.loads(sandbox_info or "{}").get("config") or {}
    except ValueError:
        return ""
    return str((config.get("linux") or {}).get("cgroup_parent", ""))


def started_container_of(
    container: cri_pb2.ContainerStatusResponse, sandbox_status: Callable[[str], cri_pb2.PodSandboxStatusResponse]
) -> tuple[ContainerRequest, str]:
    """A created container, read from the runtime's verbose ContainerStatus and its sandbox's verbose
    PodSandboxStatus (``sandbox_status``, asked for the sandbox the info names) as :func:`container_of`
    reads kubelet's CreateContainer (the config is what the shim forwarded then, its edits included),
    and the container's cgroup (its runtime spec's ``linux.cgroupsPath``). containerd's
    ``info["info"]`` holds the ContainerConfig as ``config`` (internal/cri/server/container_status.go,
    ``ContainerInfo``, whose JSON keys are the proto field names, beside ``sandboxID`` and
    ``runtimeSpec``); a runtime that gives none (CRI-O) is read from the status and the spec's process
    env. Raises :class:`StatusError` when the info is no JSON object, names no sandbox or has a config
    that can't be read."""
    try:
        info = json.loads(container.info.get("info", ""))
    except ValueError as exc:
        raise StatusError(f"its verbose status is no JSON: {exc}") from exc
    if not isinstance(info, dict):
        raise StatusError("its verbose status is no JSON object")
    spec: Mapping[str, Any] = info.get("runtimeSpec") or {}
    cgroups_path = str((spec.get("linux") or {}).get("cgroupsPath") or "")
    sandbox_id = str(info.get("sandboxID") or "")
    if not sandbox_id:
        raise StatusError("its verbose status names no sandbox")
    sandbox = sandbox_status(sandbox_id)
    status = sandbox.status
    sandbox_config = cri_pb2.PodSandboxConfig(
        metadata=status.metadata,
        labels=status.labels,
        annotations=status.annotations,
        linux=cri_pb2.LinuxPodSandboxConfig(cgroup_parent=cgroup_parent(sandbox.info.get("info", ""))),
    )
    request = cri_pb2.CreateContainerRequest(
        pod_sandbox_id=status.id, config=_config(info, spec, container.status), sandbox_config=sandbox_config
    )
    return container_of(request), cgroups_path


def _config(
    info: Mapping[str, Any], spec: Mapping[str, Any], status: cri_pb2.ContainerStatus
) -> cri_pb2.ContainerConfig:
    """The container's ContainerConfig from the runtime's verbose info; without one, what its status
    and its spec's process env say."""
    if isinstance(info.get("config"), dict):
        try:
            return ParseDict(info["config"], cri_pb2.ContainerConfig(), ignore_unknown_fields=True)
        except ParseError as exc:
            raise StatusError(f"its config can't be read: {exc}") from exc
    env = [entry.partition("=") for entry in (spec.get("process") or {}).get("env") or []]
    return cri_pb2.ContainerConfig(
        metadata=status.metadata,
        labels=status.labels,
        annotations=status.annotations,
        envs=[cri_pb2.KeyValue(key=key, value=value) for key, _, value in env],
    )


def applied(config: cri_pb2.ContainerConfig, edits: Edits) -> cri_pb2.ContainerConfig:
    """A copy of ``config`` with ``edits``: each env key set once, annotations set, the removed device
    nodes and CDI names gone and the added ones appended (a new node gets the permissions the card
    nodes it replaces had)."""
    fixed = cri_pb2.ContainerConfig()
    fixed.CopyFrom(config)
    if edits.env:
        kept = [kv for kv in fixed.envs if kv.key not in edits.env]
        del fixed.envs[:]
        fixed.envs.extend(kept)
        fixed.envs.extend(cri_pb2.KeyValue(key=k, value=v) for k, v in edits.env.items())
    for key, value in edits.annotations.items():
        fixed.annotations[key] = value
    if edits.remove_devices or edits.add_devices:
        gone = set(edits.remove_devices)
        old = [d for d in fixed.devices if d.host_path in gone or d.container_path in gone]
        permissions = old[0].permissions if old else DEFAULT_DEVICE_PERMISSIONS
        kept_devices = [d for d in fixed.devices if d not in old]
        del fixed.devices[:]
        fixed.devices.extend(kept_devices)
        fixed.devices.extend(
            cri_pb2.Device(container_path=p, host_path=p, permissions=permissions) for p in edits.add_devices
        )
    if edits.remove_cdi or edits.add_cdi:
        kept_cdi = [d for d in fixed.CDI_devices if d.name not in edits.remove_cdi]
        del fixed.CDI_devices[:]
        fixed.CDI_devices.extend(kept_cdi)
        fixed.CDI_devices.extend(cri_pb2.CDIDevice(name=name) for name in edits.add_cdi)
    return fixed
