"""Where the NRI plugin meets the transport-neutral decision (:mod:`gpushare.enforcement`): a pod and a
container as NRI shows them read as a :class:`ContainerRequest`, and a decision's :class:`Edits` written as
a ``ContainerAdjustment``.

What NRI shows differs from what the CRI shim sees (containerd v2.2 ``internal/cri/nri/nri_api_linux.go``
and ``internal/nri/container.go``): the container's env is its OCI spec's, so it holds the image's env,
the CRI config's (the device plugin's included) and what CDI specs added, every CDI device having been
applied by then; its annotations are the spec's with the CRI config's on top; and NRI's
``Container.CDI_devices`` is left empty. The DRA claims a container uses are therefore read from the
variables our claims' CDI specs set (:func:`gpushare.contract.dra.claim_env_devices`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable

from gpushare.contract.dra import claim_env_devices
from gpushare.enforcement.container import ContainerRequest, Edits, Target
from gpushare.pb import nri_pb2

#: an NRI key (env, annotation, device path) with this prefix removes the item (NRI pkg/api/helpers.go)
REMOVAL_MARK = "-"

#: the device node NRI adds for a host path (type, major, minor), read from the host
DeviceNode = Callable[[str], nri_pb2.LinuxDevice]


def env_pairs(env: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=value`` entries as (key, value), in order; an entry without ``=`` is not a variable."""
    return tuple((key, value) for key, sep, value in (entry.partition("=") for entry in env) if sep)


def container_of(pod: nri_pb2.PodSandbox, container: nri_pb2.Container) -> ContainerRequest:
    """The container as the decision reads it (see the module docstring for what NRI shows)."""
    env = env_pairs(container.env)
    named = tuple(d.name for d in container.CDI_devices)
    return ContainerRequest(
        target=Target(namespace=pod.namespace, pod=pod.name, uid=pod.uid, container=container.name),
        sandbox_annotations=dict(pod.annotations),
        env=env,
        annotations=dict(container.annotations),
        devices=tuple(d.path for d in container.linux.devices),
        cdi_devices=tuple(dict.fromkeys((*named, *claim_env_devices(key for key, _ in env)))),
        cgroup_parent=pod.linux.cgroup_parent,
    )


def host_device(path: str) -> nri_pb2.LinuxDevice:
    """The device node at ``path`` on this host, as NRI adds it to a container (the runtime allows it in
    the container's device cgroup too); OSError when there is none."""
    info = os.stat(path)
    if not (stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)):
        raise OSError(f"{path} is not a device node")
    return nri_pb2.LinuxDevice(
        path=path,
        type="c" if stat.S_ISCHR(info.st_mode) else "b",
        major=os.major(info.st_rdev),
        minor=os.minor(info.st_rdev),
        file_mode=nri_pb2.OptionalFileMode(value=stat.S_IMODE(info.st_mode)),
    )


def adjustment(edits: Edits, node: DeviceNode = host_device) -> nri_pb2.ContainerAdjustment:
    """``edits`` as NRI's adjustment. NRI replaces a variable the container has in place and appends a new
    one, and removes a device node by path before adding; it can add CDI devices but not take one away
    (``ContainerAdjustment`` has no removal for them), so ``edits.remove_cdi`` is left to the env, which
    the NVIDIA runtime reads."""
    adjust = nri_pb2.ContainerAdjustment(
        annotations=dict(edits.annotations),
        env=[nri_pb2.KeyValue(key=key, value=value) for key, value in edits.env.items()],
        CDI_devices=[nri_pb2.CDIDevice(name=name) for name in edits.add_cdi],
    )
    removed = [nri_pb2.LinuxDevice(path=REMOVAL_MARK + path) for path in edits.remove_devices]
    if removed or edits.add_devices:
        adjust.linux.devices.extend([*removed, *(node(path) for path in edits.add_devices)])
    return adjust
