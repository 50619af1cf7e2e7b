"""Kubelet's side of CRI, for the sandbox: turn a pod and its Allocate answers into the
RunPodSandbox / CreateContainer / StartContainer calls kubelet would make, then read the environment
the process really got with ExecSync."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from gpushare.contract.names import (
    CRI_LABEL_CONTAINER_NAME,
    CRI_LABEL_POD_NAME,
    CRI_LABEL_POD_NAMESPACE,
    CRI_LABEL_POD_UID,
)
from gpushare.pb import cri_pb2 as pb
from gpushare.pb import cri_pb2_grpc as pb_grpc
from gpushare.sandbox.kubeletemulator import ContainerResult


def sandbox_config(pod: Mapping[str, Any]) -> pb.PodSandboxConfig:
    """Pod annotations verbatim, pod labels plus kubelet's identity labels, host network."""
    meta = pod.get("metadata") or {}
    name, namespace, uid = meta.get("name", ""), meta.get("namespace", "default"), meta.get("uid", "")
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace=namespace, uid=uid),
        labels={
            **(meta.get("labels") or {}),
            CRI_LABEL_POD_NAME: name,
            CRI_LABEL_POD_NAMESPACE: namespace,
            CRI_LABEL_POD_UID: uid,
        },
        annotations=dict(meta.get("annotations") or {}),
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=pb.NamespaceOption(network=pb.NODE))
        ),
    )


def container_config(
    pod: Mapping[str, Any], spec: Mapping[str, Any], allocated: ContainerResult | None, image: str
) -> pb.ContainerConfig:
    """The container's own env, then the device plugin's envs; Allocate annotations as container annotations."""
    meta = pod.get("metadata") or {}
    envs = {e["name"]: str(e.get("value", "")) for e in spec.get("env") or [] if "name" in e}
    annotations: dict[str, str] = {}
    if allocated is not None:
        envs.update(allocated.envs)
        annotations.update(allocated.annotations)
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=spec["name"]),
        image=pb.ImageSpec(image=image),
        envs=[pb.KeyValue(key=k, value=v) for k, v in envs.items()],
        labels={
            CRI_LABEL_POD_NAME: meta.get("name", ""),
            CRI_LABEL_POD_NAMESPACE: meta.get("namespace", "default"),
            CRI_LABEL_POD_UID: meta.get("uid", ""),
            CRI_LABEL_CONTAINER_NAME: spec["name"],
        },
        annotations=annotations,
    )


class CriRuntime:
    """A CRI client, as kubelet holds one for its container runtime endpoint."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self.runtime = pb_grpc.RuntimeServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def run_pod(
        self, pod: Mapping[str, Any], allocated: Mapping[str, ContainerResult], image: str
    ) -> dict[str, dict[str, str]]:
        """Start every container of ``pod``; returns each container's real process env.

        Raises grpc.RpcError when the runtime (or the shim in front of it) refuses a container.
        """
        sandbox = sandbox_config(pod)
        sandbox_id = self.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox), timeout=60).pod_sandbox_id
        envs: dict[str, dict[str, str]] = {}
        for spec in (pod.get("spec") or {}).get("containers") or []:
            config = container_config(pod, spec, allocated.get(spec["name"]), image)
            created = self.runtime.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox), timeout=60
            )
            self.runtime.StartContainer(pb.StartContainerRequest(container_id=created.container_id), timeout=60)
            envs[spec["name"]] = self.process_env(created.container_id)
        return envs

    def process_env(self, container_id: str) -> dict[str, str]:
        reply = self.runtime.ExecSync(
            pb.ExecSyncRequest(container_id=container_id, cmd=["env"], timeout=10), timeout=20
        )
        return dict(line.split("=", 1) for line in reply.stdout.decode().splitlines() if "=" in line)
