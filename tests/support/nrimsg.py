"""NRI's PodSandbox and Container as containerd shows them to a plugin, built from the CRI messages of
tests/support/cri.py (the device plugin's answer as kubelet passed it on)."""

from __future__ import annotations

from collections.abc import Mapping

from gpushare.enforcement.container import Target
from gpushare.pb import cri_pb2, nri_pb2

SANDBOX = "sandbox-1"


def nri_pod(
    target: Target, annotations: Mapping[str, str], sandbox: str = SANDBOX, cgroup: str = ""
) -> nri_pb2.PodSandbox:
    return nri_pb2.PodSandbox(
        id=sandbox,
        name=target.pod,
        uid=target.uid,
        namespace=target.namespace,
        annotations=dict(annotations),
        linux=nri_pb2.LinuxPodSandbox(cgroup_parent=cgroup),
    )


def nri_container(
    config: cri_pb2.ContainerConfig,
    container_id: str = "ctr-1",
    sandbox: str = SANDBOX,
    state: int = nri_pb2.CONTAINER_RUNNING,
    *extra_env: str,
    cgroups_path: str = "",
) -> nri_pb2.Container:
    """The container of ``config``: its env as the OCI spec has it (``KEY=value``, then ``extra_env``,
    which CDI specs or the image added), its annotations, its device nodes; no CDI names (containerd 2.2
    leaves them out)."""
    return nri_pb2.Container(
        id=container_id,
        pod_sandbox_id=sandbox,
        name=config.metadata.name,
        state=state,
        annotations=dict(config.annotations),
        env=[*(f"{kv.key}={kv.value}" for kv in config.envs), *extra_env],
        linux=nri_pb2.LinuxContainer(
            devices=[nri_pb2.LinuxDevice(path=d.host_path, type="c") for d in config.devices],
            cgroups_path=cgroups_path,
        ),
    )


def adjusted_env(response: nri_pb2.CreateContainerResponse) -> dict[str, str]:
    return {kv.key: kv.value for kv in response.adjust.env}
