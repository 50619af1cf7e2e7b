"""What the NRI plugin makes of the runtime's containers at Synchronize, without I/O: which sandboxes
run, whose limits go, and which live containers see what they must not and are evicted."""

from __future__ import annotations

from gpushare.nriplugin.sync import Running, ended_pods, evictions, live_containers, misplaced, sandbox_states
from support.cri import container_for, plain_config, plugin_config
from support.crishim import A0, A1, POD, slice_of
from support.nrimsg import nri_container, nri_pod

from gpushare.assignment import Refusal
from gpushare.contract.names import ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID
from gpushare.enforcement.container import Target
from gpushare.enforcement.limits import SandboxState
from gpushare.enforcement.resolve import Resolution
from gpushare.pb import nri_pb2

SIDECAR = Target(POD.namespace, POD.pod, POD.uid, "sidecar")


def gpu(*slices: object) -> Resolution:
    return Resolution(target=POD, wants_gpu=True, slices=slices)


def test_a_sandbox_runs_while_one_of_its_containers_is_live() -> None:
    pods = [nri_pod(POD, {}, "old"), nri_pod(POD, {}, "new"), nri_pod(SIDECAR, {}, "idle")]
    containers = [
        nri_container(plain_config(), "c1", "old", nri_pb2.CONTAINER_STOPPED),
        nri_container(plain_config(), "c2", "new", nri_pb2.CONTAINER_RUNNING),
    ]
    states = sandbox_states(pods, containers)
    assert states == [
        SandboxState("old", POD.uid, False),
        SandboxState("new", POD.uid, True),
        SandboxState("idle", POD.uid, False),
    ]
    assert [(pod.id, c.id) for pod, c in live_containers(pods, containers)] == [("new", "c2")]


def test_a_stopped_sandboxs_limits_go_only_when_its_pod_runs_nowhere() -> None:
    other = Target("default", "infer", "uid-infer", "worker")
    pods = [nri_pod(POD, {}, "old"), nri_pod(POD, {}, "new"), nri_pod(other, {}, "done")]
    states = [
        SandboxState("old", POD.uid, False),
        SandboxState("new", POD.uid, True),
        SandboxState("done", other.uid, False),
    ]
    assert [pod.id for pod in ended_pods(pods, states)] == ["done"]


def test_a_gpu_container_on_another_card_is_named_with_its_pod_and_cards() -> None:
    request = container_for(POD, {}, plugin_config(POD, [slice_of(A1)]))
    why = misplaced(request, gpu(slice_of(A0)), True)
    assert why is not None and "pod default/train container worker" in why
    assert f"{ENV_VISIBLE_DEVICES}={A1.uuid}" in why and A0.uuid in why
    assert misplaced(container_for(POD, {}, plugin_config(POD, [slice_of(A0)])), gpu(slice_of(A0)), True) is None


def test_what_the_container_sees_is_its_env_not_the_device_plugins_annotations() -> None:
    """After the plugin's adjustment the env names the assigned card, while the container's annotations
    still show what the device plugin gave (containerd puts the CRI config's on top)."""
    config = plugin_config(POD, [slice_of(A1)])
    config.envs.add(key=ENV_VISIBLE_DEVICES, value=A0.uuid)
    request = container_for(POD, {}, config)
    assert request.env_values(ENV_VISIBLE_DEVICES) == [A1.uuid, A0.uuid]
    assert misplaced(request, gpu(slice_of(A0)), True) is not None  # two values: not what it was given
    fixed = plugin_config(POD, [slice_of(A1)])
    del fixed.envs[:]
    fixed.envs.add(key=ENV_VISIBLE_DEVICES, value=A0.uuid)
    assert misplaced(container_for(POD, {}, fixed), gpu(slice_of(A0)), True) is None


def test_a_container_without_gpus_that_sees_one_is_misplaced_unless_blocking_is_off() -> None:
    no_gpu = Resolution(target=SIDECAR, wants_gpu=False)
    sees_all = container_for(SIDECAR, {}, plain_config((ENV_VISIBLE_DEVICES, "all")))
    why = misplaced(sees_all, no_gpu, True)
    assert why == f"pod default/train container sidecar requests no GPU but sees {ENV_VISIBLE_DEVICES}=all"
    assert misplaced(sees_all, no_gpu, False) is None
    for value in (VISIBLE_DEVICES_VOID, "", "none"):
        assert misplaced(container_for(SIDECAR, {}, plain_config((ENV_VISIBLE_DEVICES, value))), no_gpu, True) is None
    assert misplaced(container_for(SIDECAR, {}, plain_config(("A", "b"))), no_gpu, True) is None


def test_a_container_whose_assignment_cant_be_read_now_is_left_running() -> None:
    refused = Resolution(target=POD, wants_gpu=True, refusal=Refusal("api-unavailable", "no API server"))
    assert misplaced(container_for(POD, {}, plugin_config(POD, [slice_of(A1)])), refused, True) is None


def test_a_claims_container_must_see_the_env_of_its_claims_cards() -> None:
    resolution = Resolution(target=POD, wants_gpu=True, dra_devices=("x",), dra_env={ENV_VISIBLE_DEVICES: A1.uuid})
    wrong = container_for(POD, {}, plain_config((ENV_VISIBLE_DEVICES, A0.uuid)))
    right = container_for(POD, {}, plain_config((ENV_VISIBLE_DEVICES, A1.uuid)))
    assert A1.uuid in (misplaced(wrong, resolution, True) or "")
    assert misplaced(right, resolution, True) is None


def test_the_gpu_containers_of_a_pod_without_its_limits_are_evicted_and_only_they() -> None:
    right = container_for(POD, {}, plugin_config(POD, [slice_of(A0)]))
    sidecar = container_for(SIDECAR, {}, plain_config((ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID)))
    running = [
        Running("gpu", right, gpu(slice_of(A0))),
        Running("plain", sidecar, Resolution(target=SIDECAR, wants_gpu=False)),
    ]
    assert evictions(running, {}, True) == []
    found = evictions(running, {POD.uid: "card 0: Insufficient Resources"}, True)
    assert [(e.container_id, e.reason) for e in found] == [
        ("gpu", "pod default/train container worker runs without its memory limits: card 0: Insufficient Resources")
    ]
