"""gpushare's NRI plugin (the node agent's default enforcement) against a real containerd 2.2.9: pods and
containers are made through CRI as kubelet makes them, with the device plugin's Allocate answer in their
env and annotations, and what a container gets is read back from its process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from gpushare.nriplugin.handler import Handler
from gpushare.nriplugin.wiring import NriSettings, RunningPlugin, cri_evictor
from support.cri import plugin_config
from support.crishim import A0, A1, CARDS, allocation_of, slice_of
from support.waiting import wait_until

from gpushare.cards import ENFORCED
from gpushare.contract.names import (
    ENV_MEM_IDX,
    ENV_VISIBLE_DEVICES,
    NRI_PLUGIN_INDEX,
    NRI_PLUGIN_NAME,
    VISIBLE_DEVICES_VOID,
)
from gpushare.contract.units import GIB
from gpushare.enforcement.container import Target
from gpushare.enforcement.decide import Enforcer
from gpushare.enforcement.resolve import Resolver
from gpushare.memlimits.cgroups import detect_layout, unified_path
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.pb import cri_pb2 as cri
from gpushare.sandbox import cri_kubelet
from gpushare.sandbox.containerd import TEST_IMAGE, Containerd, containerd_available
from gpushare.settings import RewriteOptions

pytestmark = pytest.mark.skipif(containerd_available() is not None, reason=str(containerd_available()))


def start_plugin(containerd: Containerd, limiter: PodLimiter | None = None) -> RunningPlugin:
    """The plugin as the node agent runs it, trusting the sandbox's annotations alone (no API server)
    and setting no memory limits (the simulated cards enforce none), or, given a ``limiter``, on cards
    that enforce them."""
    cards = CARDS if limiter is None else [replace(c, memory_limits=ENFORCED) for c in CARDS]
    enforcer = Enforcer(Resolver(GIB, None), lambda: cards, GIB, RewriteOptions(), None, limiter)
    handler = Handler(enforcer, cri_evictor(containerd.address), limiting=limiter is not None)
    return RunningPlugin(handler, NriSettings(str(containerd.nri_socket), NRI_PLUGIN_NAME, NRI_PLUGIN_INDEX)).start()


@pytest.fixture
def plugin(containerd: Containerd) -> Iterator[RunningPlugin]:
    running = start_plugin(containerd)
    try:
        wait_until(running.ready, 20, "the plugin registered with containerd")
        yield running
    finally:
        running.stop()


def target(pod: str) -> Target:
    return Target("default", pod, f"uid-{pod}", "worker")


def kubelets_config(who: Target, *slices: object, **env: str) -> cri.ContainerConfig:
    """The container's config as kubelet builds it from the device plugin's Allocate answer meant for
    ``who`` (its env and annotations; no device nodes: the simulated cards have none), plus ``env``."""
    config = plugin_config(who, list(slices)) if slices else cri.ContainerConfig()
    del config.devices[:]
    del config.CDI_devices[:]
    config.metadata.name = "worker"
    config.image.image = TEST_IMAGE
    config.envs.extend(cri.KeyValue(key=k, value=v) for k, v in env.items())
    return config


def create(
    crictl: cri_kubelet.CriRuntime,
    pod: Target,
    annotations: dict[str, str],
    config: cri.ContainerConfig,
    cgroup_parent: str = "",
) -> str:
    """Run ``pod``'s sandbox with ``annotations`` (the pod's), create and start the container; its id."""
    sandbox = cri_kubelet.sandbox_config(
        {"metadata": {"name": pod.pod, "namespace": pod.namespace, "uid": pod.uid, "annotations": annotations}}
    )
    sandbox.linux.cgroup_parent = cgroup_parent
    sandbox_id = crictl.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox), timeout=60).pod_sandbox_id
    created = crictl.runtime.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox), timeout=60
    ).container_id
    crictl.runtime.StartContainer(cri.StartContainerRequest(container_id=created), timeout=60)
    return created


def state(crictl: cri_kubelet.CriRuntime, container_id: str) -> int:
    reply = crictl.runtime.ContainerStatus(cri.ContainerStatusRequest(container_id=container_id), timeout=30)
    return reply.status.state


def test_a_container_given_another_pods_card_runs_on_its_assigned_card(
    crictl: cri_kubelet.CriRuntime, plugin: RunningPlugin
) -> None:
    train = target("train")
    swapped = kubelets_config(target("infer"), slice_of(A1))  # the device plugin served infer's card
    env = crictl.process_env(create(crictl, train, allocation_of(worker=(slice_of(A0),)), swapped))
    assert env[ENV_VISIBLE_DEVICES] == A0.uuid and env[ENV_MEM_IDX] == str(A0.index)


def test_a_container_requesting_no_gpu_that_sets_all_sees_void(
    crictl: cri_kubelet.CriRuntime, plugin: RunningPlugin
) -> None:
    config = kubelets_config(target("plain"), **{ENV_VISIBLE_DEVICES: "all", "KEEP": "me"})
    env = crictl.process_env(create(crictl, target("plain"), {}, config))
    assert env[ENV_VISIBLE_DEVICES] == VISIBLE_DEVICES_VOID and env["KEEP"] == "me"


def test_a_gpu_container_without_a_valid_assignment_is_refused_naming_its_pod(
    crictl: cri_kubelet.CriRuntime, plugin: RunningPlugin
) -> None:
    orphan = target("orphan")
    with pytest.raises(grpc.RpcError) as refused:
        create(crictl, orphan, {}, kubelets_config(orphan, slice_of(A0)))
    assert "pod default/orphan container worker" in (refused.value.details() or "")


def test_a_container_created_on_the_wrong_card_while_the_plugin_was_away_is_evicted_when_it_comes(
    containerd: Containerd, crictl: cri_kubelet.CriRuntime
) -> None:
    """The containers the plugin corrected before it went away, and those that never saw a card, run on."""
    assignment = allocation_of(worker=(slice_of(A0),))
    swapped = kubelets_config(target("infer"), slice_of(A1))
    first = start_plugin(containerd)
    try:
        wait_until(first.ready, 20, "the plugin registered with containerd")
        corrected = create(crictl, target("before"), assignment, swapped)
    finally:
        first.stop()
    wrong = create(crictl, target("away"), assignment, swapped)
    plain = create(crictl, target("quiet"), {}, kubelets_config(target("quiet"), **{ENV_VISIBLE_DEVICES: "void"}))
    assert crictl.process_env(wrong)[ENV_VISIBLE_DEVICES] == A1.uuid
    running = start_plugin(containerd)
    try:
        wait_until(lambda: state(crictl, wrong) == cri.CONTAINER_EXITED, 30, "the misplaced container evicted")
        running.audited(10)
        assert state(crictl, plain) == cri.CONTAINER_RUNNING
        assert state(crictl, corrected) == cri.CONTAINER_RUNNING
    finally:
        running.stop()


def test_with_limits_on_a_gpu_container_is_capped_on_its_own_cgroup_before_its_process_runs(
    containerd: Containerd, crictl: cri_kubelet.CriRuntime
) -> None:
    """The pod's cgroup at CreateContainer, then, at StartContainer, the cgroup containerd's runtime spec
    names for the container: the one its process then runs in."""
    layout = detect_layout(Path("/proc/self/mountinfo").read_text())
    if layout.unified is None:
        pytest.skip("no cgroup v2 hierarchy on this machine: containers' cgroups can't be checked")
    calls: list[tuple[str, Path, int, int]] = []
    running = start_plugin(containerd, PodLimiter(lambda *call: calls.append(call), layout, GIB))
    try:
        wait_until(running.ready, 20, "the plugin registered with containerd")
        capped = target("capped")
        config = kubelets_config(capped, slice_of(A0, 8))
        created = create(crictl, capped, allocation_of(worker=(slice_of(A0, 8),)), config, "/gpushare-nri-test/capped")
        status = crictl.runtime.ContainerStatus(cri.ContainerStatusRequest(container_id=created, verbose=True))
        pid = json.loads(status.info["info"])["pid"]
        process_cgroup = unified_path(Path(f"/proc/{pid}/cgroup").read_text()) or ""
    finally:
        running.stop()
    own = layout.unified / process_cgroup.lstrip("/")
    mine = layout.unified / "gpushare-nri-test"  # the sweep at Synchronize may look at the machine's own pods
    assert [call for call in calls if call[1].is_relative_to(mine)] == [
        (A0.uuid, layout.unified / "gpushare-nri-test" / "capped", 8 << 30, 8 << 30),  # the pod's, at creation
        (A0.uuid, own, 0, 8 << 30),  # the container's own, before its process ran
    ]
