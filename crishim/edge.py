"""Where the CRI shim meets the transport-neutral decision (:mod:`gpushare.enforcement`): a
CreateContainer request read as a :class:`ContainerRequest`, and a decision's :class:`Edits` written into
a copy of its ContainerConfig."""

from __future__ import annotations

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
