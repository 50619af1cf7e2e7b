"""CRI messages as kubelet sends them to the shim, for the tests of tests/crishim."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpushare.crishim.edge import applied, container_of

from gpushare.assignment import Refusal
from gpushare.cards import Card
from gpushare.contract.allocation import CardSlice
from gpushare.contract.env import assigned_env, toolkit_memory_env
from gpushare.contract.names import (
    CTR_ANN_CARDS,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD,
    CTR_ANN_POD_UID,
    cdi_device_name,
    device_file,
)
from gpushare.contract.units import GIB, MemoryUnit
from gpushare.enforcement.container import ContainerRequest, Target
from gpushare.enforcement.resolve import Resolution
from gpushare.enforcement.rewrite import rewrite
from gpushare.pb import cri_pb2
from gpushare.settings import RewriteOptions
from support.crishim import CARDS, UNITS


def plugin_config(target: Target, slices: Sequence[CardSlice], pod_mem: int = 20) -> cri_pb2.ContainerConfig:
    """A ContainerConfig as kubelet builds it from a device plugin answer meant for ``target``."""
    env = assigned_env(tuple(slices), pod_mem, UNITS) | toolkit_memory_env(tuple(slices), GIB.mib)
    return cri_pb2.ContainerConfig(
        metadata=cri_pb2.ContainerMetadata(name=target.container),
        image=cri_pb2.ImageSpec(image="busybox"),
        envs=[cri_pb2.KeyValue(key="PATH", value="/bin"), *(cri_pb2.KeyValue(key=k, value=v) for k, v in env.items())],
        annotations={
            CTR_ANN_POD_UID: target.uid,
            CTR_ANN_POD: target.pod_key,
            CTR_ANN_CONTAINER: target.container,
            CTR_ANN_CARDS: ",".join(s.uuid for s in slices),
        },
        devices=[
            cri_pb2.Device(
                container_path=device_file(CARDS[s.index].minor),
                host_path=device_file(CARDS[s.index].minor),
                permissions="rw",
            )
            for s in slices
        ],
        CDI_devices=[cri_pb2.CDIDevice(name=cdi_device_name(s.uuid)) for s in slices],
    )


def env_of(config: cri_pb2.ContainerConfig) -> dict[str, list[str]]:
    env: dict[str, list[str]] = {}
    for kv in config.envs:
        env.setdefault(kv.key, []).append(kv.value)
    return env


def plain_config(*env: tuple[str, str]) -> cri_pb2.ContainerConfig:
    return cri_pb2.ContainerConfig(
        metadata=cri_pb2.ContainerMetadata(name="sidecar"), envs=[cri_pb2.KeyValue(key=k, value=v) for k, v in env]
    )


def request_for(
    target: Target, annotations: Mapping[str, str], config: cri_pb2.ContainerConfig
) -> cri_pb2.CreateContainerRequest:
    return cri_pb2.CreateContainerRequest(
        pod_sandbox_id="sb",
        config=config,
        sandbox_config=cri_pb2.PodSandboxConfig(
            metadata=cri_pb2.PodSandboxMetadata(name=target.pod, namespace=target.namespace, uid=target.uid),
            annotations=dict(annotations),
        ),
    )


def container_for(target: Target, annotations: Mapping[str, str], config: cri_pb2.ContainerConfig) -> ContainerRequest:
    """:func:`request_for` as the shim's edge reads it."""
    return container_of(request_for(target, annotations, config))


@dataclass(frozen=True, slots=True)
class Rewritten:
    """A decision as the CRI shim applies it: the corrected config (None: forwarded unchanged)."""

    config: cri_pb2.ContainerConfig | None
    refusal: Refusal | None
    reason: str
    message: str


def rewrite_config(
    config: cri_pb2.ContainerConfig,
    resolution: Resolution,
    cards: Sequence[Card],
    unit: MemoryUnit,
    options: RewriteOptions,
) -> Rewritten:
    """:func:`gpushare.enforcement.rewrite.rewrite` of ``config`` for ``resolution``'s container, applied
    to ``config`` as the shim's edge does."""
    decision = rewrite(container_for(resolution.target, {}, config), resolution, cards, unit, options)
    fixed = applied(config, decision.edits) if decision.edits is not None else None
    return Rewritten(fixed, decision.refusal, decision.reason, decision.message)
