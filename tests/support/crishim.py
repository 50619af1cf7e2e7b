"""The CRI shim's cards, containers and pods as the tests of tests/crishim build them: node-a holds two
A100-80GB and a T4."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpushare.crishim.resolve import Target
from podfactory import container, gpu_pod

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.env import assigned_env
from gpushare.contract.names import (
    ANN_ALLOCATION,
    CTR_ANN_CARDS,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD,
    CTR_ANN_POD_UID,
    cdi_device_name,
    device_file,
)
from gpushare.contract.pending import Ledger
from gpushare.contract.units import GIB
from gpushare.inventory import simulated_cards
from gpushare.kube.errors import KubeUnavailable
from gpushare.pb import cri_pb2

CARDS = simulated_cards("node-a", "2xA100-80GB:81920,1xT4:15360")
A0, A1, T4 = CARDS
UNITS = {c.uuid: GIB.units_of(c.memory_mib) for c in CARDS}
POD = Target(namespace="default", pod="train", uid="uid-train", container="worker")


def slice_of(card: Any, units: int = 20) -> CardSlice:
    return CardSlice(index=card.index, uuid=card.uuid, units=units)


def plugin_config(target: Target, slices: Sequence[CardSlice], pod_mem: int = 20) -> cri_pb2.ContainerConfig:
    """A ContainerConfig as kubelet builds it from a device plugin answer meant for ``target``."""
    env = assigned_env(tuple(slices), pod_mem, UNITS)
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


def allocation_of(**containers: tuple[CardSlice, ...]) -> dict[str, str]:
    return {ANN_ALLOCATION: format_allocation(containers)}


class FakePods:
    """The pods the shim asks the API about, and the node's ledger."""

    def __init__(self, pods: list[dict[str, Any]], fail: bool = False, synced: bool = True) -> None:
        self.pods = pods
        self.fail = fail
        self.synced = synced
        self.asked: list[tuple[str, str]] = []
        #: the node's ledger
        self.recorded: Ledger = {}

    def pod(self, namespace: str, name: str, uid: str) -> Mapping[str, Any] | None:
        self.asked.append((namespace, name))
        if self.fail:
            raise KubeUnavailable(f"pod {namespace}/{name}: API server unreachable")
        return next((p for p in self.pods if p["metadata"]["name"] == name and p["metadata"]["uid"] == uid), None)

    def node_pods(self) -> Sequence[Mapping[str, Any]] | None:
        return self.pods if self.synced else None

    def ledger(self) -> Ledger:
        return self.recorded


def pod_dict(name: str, uid: str, allocation: dict[str, tuple[CardSlice, ...]] | None, mem: int = 20) -> dict[str, Any]:
    """A running pod on node-a: a worker asking for ``mem`` units and a sidecar asking for none."""
    return gpu_pod(
        name,
        [container("worker", mem), {"name": "sidecar"}],
        node="node-a",
        uid=uid,
        phase="Running",
        extra_annotations=allocation_of(**allocation) if allocation else None,
    )
