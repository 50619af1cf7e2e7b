"""The CreateContainer decision without any server: assignment resolution and config correction."""

from __future__ import annotations

import logging

import grpc
import pytest
from gpushare.crishim.edge import container_of
from gpushare.crishim.server import CreateContainerGuard
from gpushare.crishim.splice import Forward, Refuse
from support.cri import container_for, env_of, plain_config, plugin_config, request_for, rewrite_config
from support.crishim import A0, A1, CARDS, POD, T4, UNITS, FakePods, allocation_of, pod_dict, slice_of

from gpushare.assignment import Refusal
from gpushare.contract.allocation import CardSlice
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_GPU_MODEL,
    ANN_MEM_IDX,
    CDI_KIND,
    CRI_LABEL_CONTAINER_NAME,
    CTR_ANN_CARDS,
    CTR_ANN_POD,
    CTR_ANN_POD_UID,
    DEV_CONTROL_FILES,
    ENV_MEM_CONTAINER,
    ENV_MEM_DEV,
    ENV_MEM_IDX,
    ENV_MEM_POD,
    ENV_VISIBLE_DEVICES,
    VISIBLE_DEVICES_VOID,
    cdi_device_name,
    device_file,
)
from gpushare.contract.units import GIB
from gpushare.enforcement.container import Target
from gpushare.enforcement.resolve import SOURCE_API, Resolution, Resolver, from_annotations, plugin_view
from gpushare.pb import cri_pb2
from gpushare.settings import RewriteOptions

OTHER = Target(namespace="default", pod="infer", uid="uid-infer", container="worker")


def gpu(target: Target, *slices: CardSlice, pod_mem: int = 20) -> Resolution:
    return Resolution(target=target, wants_gpu=True, slices=slices, pod_mem=pod_mem)


# --- correcting a device plugin answer ----------------------------------------------------------------


def test_swapped_answer_is_rebuilt_from_the_assignment() -> None:
    config = plugin_config(OTHER, [slice_of(A1)])  # the plugin served the other pod's card
    outcome = rewrite_config(config, gpu(POD, slice_of(A0)), CARDS, GIB, RewriteOptions())
    assert outcome.refusal is None and outcome.reason == "wrong-card"
    env = env_of(outcome.config)
    assert env[ENV_VISIBLE_DEVICES] == [A0.uuid]
    assert env[ENV_MEM_IDX] == ["0"] and env[ENV_MEM_CONTAINER] == ["20"] and env[ENV_MEM_POD] == ["20"]
    assert env[ENV_MEM_DEV] == [str(UNITS[A0.uuid])]
    assert env["PATH"] == ["/bin"]
    assert outcome.config.annotations[CTR_ANN_CARDS] == A0.uuid
    assert outcome.config.annotations[CTR_ANN_POD] == POD.pod_key
    assert outcome.config.annotations[CTR_ANN_POD_UID] == POD.uid
    assert "card 0" in outcome.message and POD.pod_key in outcome.message and A1.uuid in outcome.message
    # devices and CDI names are left alone unless enabled
    assert [d.host_path for d in outcome.config.devices] == [device_file(A1.minor)]
    assert [d.name for d in outcome.config.CDI_devices] == [cdi_device_name(A1.uuid)]


def test_matching_answer_is_forwarded_untouched() -> None:
    config = plugin_config(POD, [slice_of(A0)])
    outcome = rewrite_config(config, gpu(POD, slice_of(A0)), CARDS, GIB, RewriteOptions(rewrite_devices=True, cdi=True))
    assert outcome.config is None and outcome.refusal is None and outcome.reason == ""


def test_same_card_served_for_another_pod_is_relabelled() -> None:
    config = plugin_config(OTHER, [slice_of(A0)])
    outcome = rewrite_config(config, gpu(POD, slice_of(A0)), CARDS, GIB, RewriteOptions())
    assert outcome.reason == "wrong-pod"
    assert outcome.config.annotations[CTR_ANN_POD_UID] == POD.uid


def test_spec_env_overriding_the_plugin_is_corrected() -> None:
    config = plugin_config(POD, [slice_of(A0)])
    config.envs.append(cri_pb2.KeyValue(key=ENV_VISIBLE_DEVICES, value="all"))
    outcome = rewrite_config(config, gpu(POD, slice_of(A0)), CARDS, GIB, RewriteOptions())
    assert outcome.reason == "env-mismatch"
    assert env_of(outcome.config)[ENV_VISIBLE_DEVICES] == [A0.uuid]  # exactly once


def test_device_nodes_follow_the_minor_number_not_the_index() -> None:
    config = plugin_config(OTHER, [slice_of(A1)])
    config.devices.append(cri_pb2.Device(container_path="/dev/fuse", host_path="/dev/fuse", permissions="rwm"))
    config.devices.append(cri_pb2.Device(container_path="/dev/nvidiactl", host_path="/dev/nvidiactl", permissions="rw"))
    outcome = rewrite_config(config, gpu(POD, slice_of(A0)), CARDS, GIB, RewriteOptions(rewrite_devices=True))
    paths = [d.host_path for d in outcome.config.devices]
    assert A0.minor != A0.index
    assert device_file(A0.minor) in paths and device_file(A1.minor) not in paths
    assert sorted(p for p in paths if p in DEV_CONTROL_FILES) == sorted(DEV_CONTROL_FILES)
    assert "/dev/fuse" in paths


def test_cdi_names_are_replaced_and_other_kinds_kept() -> None:
    config = plugin_config(OTHER, [slice_of(A1)])
    config.CDI_devices.append(cri_pb2.CDIDevice(name="vendor.example/fpga=0"))
    outcome = rewrite_config(config, gpu(POD, slice_of(A0), slice_of(T4)), CARDS, GIB, RewriteOptions(cdi=True))
    names = [d.name for d in outcome.config.CDI_devices]
    assert names == ["vendor.example/fpga=0", cdi_device_name(A0.uuid), cdi_device_name(T4.uuid)]
    assert all(not n.startswith(CDI_KIND) or A1.uuid not in n for n in names)
    assert env_of(outcome.config)[ENV_VISIBLE_DEVICES] == [f"{A0.uuid},{T4.uuid}"]


def test_card_unknown_to_this_node_is_refused() -> None:
    ghost = CardSlice(index=7, uuid="GPU-00000000-0000-0000-0000-000000000000", units=4)
    outcome = rewrite_config(plugin_config(POD, [slice_of(A0)]), gpu(POD, ghost), CARDS, GIB, RewriteOptions())
    assert outcome.refusal is not None and outcome.refusal.reason == "unknown-card"
    assert POD.pod_key in outcome.refusal.message and ghost.uuid in outcome.refusal.message


def test_card_index_disagreeing_with_the_node_is_refused() -> None:
    wrong = CardSlice(index=1, uuid=A0.uuid, units=4)
    outcome = rewrite_config(plugin_config(POD, [slice_of(A0)]), gpu(POD, wrong), CARDS, GIB, RewriteOptions())
    assert outcome.refusal is not None and "index 0" in outcome.refusal.message


# --- containers that request no GPU ---------------------------------------------------------------------


NO_GPU = Resolution(target=POD, wants_gpu=False)


def test_unrequested_gpu_is_voided() -> None:
    outcome = rewrite_config(
        plain_config((ENV_VISIBLE_DEVICES, "all"), ("A", "b")), NO_GPU, CARDS, GIB, RewriteOptions()
    )
    assert outcome.reason == "unrequested-gpu" and "all" in outcome.message
    assert env_of(outcome.config) == {"A": ["b"], ENV_VISIBLE_DEVICES: [VISIBLE_DEVICES_VOID]}


def test_no_gpu_container_gets_void_even_without_asking() -> None:
    """An image can carry NVIDIA_VISIBLE_DEVICES=all; the container's own env must override it."""
    outcome = rewrite_config(plain_config(("A", "b")), NO_GPU, CARDS, GIB, RewriteOptions())
    assert outcome.reason == ""
    assert env_of(outcome.config)[ENV_VISIBLE_DEVICES] == [VISIBLE_DEVICES_VOID]


def test_blocking_can_be_turned_off() -> None:
    config = plain_config((ENV_VISIBLE_DEVICES, "all"))
    assert rewrite_config(config, NO_GPU, CARDS, GIB, RewriteOptions(block_unrequested_gpu=False)).config is None


def test_refusal_from_resolution_is_passed_on() -> None:
    refused = Resolution(target=POD, wants_gpu=True, refusal=Refusal("overcommit", "full"))
    assert (
        rewrite_config(plugin_config(POD, [slice_of(A0)]), refused, CARDS, GIB, RewriteOptions()).refusal
        == refused.refusal
    )


# --- reading the assignment from the sandbox annotations ---------------------------------------------------


def test_target_falls_back_to_labels() -> None:
    request = request_for(POD, {}, cri_pb2.ContainerConfig(labels={CRI_LABEL_CONTAINER_NAME: "worker"}))
    assert container_of(request).target == POD


def test_allocation_annotation_names_the_cards() -> None:
    annotations = allocation_of(worker=(slice_of(A1),), helper=(slice_of(T4, 5),))
    found = from_annotations(
        POD, annotations, plugin_view(container_for(POD, {}, plugin_config(OTHER, [slice_of(A0)]))), CARDS
    )
    assert found is not None and found.wants_gpu and found.slices == (slice_of(A1),)
    assert found.pod_mem == 20  # the pod's effective gpu-mem, as the device plugin put it in the env


def test_container_outside_the_allocation_wants_no_gpu_unless_the_plugin_served_it() -> None:
    annotations = allocation_of(worker=(slice_of(A1),))
    other = Target(POD.namespace, POD.pod, POD.uid, "sidecar")
    assert from_annotations(
        other, annotations, plugin_view(container_for(POD, {}, plain_config())), CARDS
    ) == Resolution(other, wants_gpu=False)
    assert (
        from_annotations(
            other, annotations, plugin_view(container_for(POD, {}, plugin_config(other, [slice_of(A0)]))), CARDS
        )
        is None
    )


def test_original_extender_index_is_read_as_a_minor_number() -> None:
    served = plugin_view(container_for(POD, {}, plugin_config(OTHER, [slice_of(A0, 12)], pod_mem=12)))
    found = from_annotations(POD, {ANN_MEM_IDX: "2"}, served, CARDS)
    assert A0.minor == 2  # the simulated cards' minors run backwards
    assert found is not None and found.slices == (CardSlice(index=0, uuid=A0.uuid, units=12),)
    assert from_annotations(POD, {ANN_MEM_IDX: "9"}, served, CARDS) is None


@pytest.mark.parametrize(
    "annotations",
    [{}, {ANN_ALLOCATION: "{not json"}, allocation_of(worker=(CardSlice(0, "GPU-elsewhere", 3),))],
    ids=["missing", "malformed", "foreign-card"],
)
def test_unusable_annotations_leave_it_open(annotations: dict[str, str]) -> None:
    assert (
        from_annotations(
            POD, annotations, plugin_view(container_for(POD, {}, plugin_config(POD, [slice_of(A0)]))), CARDS
        )
        is None
    )


# --- the resolver with the API fallback --------------------------------------------------------------------


def test_without_api_a_served_container_lacking_annotations_is_refused() -> None:
    request = request_for(POD, {}, plugin_config(OTHER, [slice_of(A1)]))
    found = Resolver(GIB, None).resolve(container_of(request), CARDS)
    assert found.refusal is not None and found.refusal.reason == "no-assignment"
    assert POD.pod_key in found.refusal.message and "worker" in found.refusal.message


def test_missing_annotations_are_read_from_the_api() -> None:
    pods = FakePods([pod_dict("train", "uid-train", {"worker": (slice_of(A0),)})])
    found = Resolver(GIB, pods).resolve(container_for(POD, {}, plugin_config(OTHER, [slice_of(A1)])), CARDS)
    assert found.refusal is None and found.source == SOURCE_API and found.slices == (slice_of(A0),)
    assert pods.asked == [("default", "train")]


def test_api_spec_decides_a_container_without_a_request() -> None:
    pods = FakePods([pod_dict("train", "uid-train", {"worker": (slice_of(A0),)})])
    sidecar = Target(POD.namespace, POD.pod, POD.uid, "sidecar")
    config = plugin_config(sidecar, [slice_of(A1)])
    found = Resolver(GIB, pods).resolve(container_for(sidecar, {}, config), CARDS)
    assert found.refusal is None and not found.wants_gpu


def test_api_pod_without_assignment_is_refused() -> None:
    pods = FakePods([pod_dict("train", "uid-train", None)])
    found = Resolver(GIB, pods).resolve(container_for(POD, {}, plugin_config(POD, [slice_of(A0)])), CARDS)
    assert found.refusal is not None and found.refusal.reason == "no-assignment"


def test_unreachable_api_is_refused_not_guessed() -> None:
    found = Resolver(GIB, FakePods([], fail=True)).resolve(
        container_for(POD, {}, plugin_config(POD, [slice_of(A0)])), CARDS
    )
    assert found.refusal is not None and found.refusal.reason == "api-unavailable"


def test_overcommitted_card_is_refused() -> None:
    capacity = UNITS[A0.uuid]
    others = [pod_dict(f"p{i}", f"uid-{i}", {"worker": (slice_of(A0, 30),)}, mem=30) for i in range(2)]
    mine = {"worker": (slice_of(A0, 30),)}
    pods = FakePods([*others, pod_dict("train", "uid-train", mine, mem=30)])
    request = request_for(POD, allocation_of(**mine), plugin_config(POD, [slice_of(A0, 30)], pod_mem=30))
    found = Resolver(GIB, pods).resolve(container_of(request), CARDS)
    assert capacity < 90 and found.refusal is not None and found.refusal.reason == "overcommit"
    assert "over-committed" in found.refusal.message
    # the same request fits once one of the other pods has finished
    others[0]["status"]["phase"] = "Succeeded"
    assert Resolver(GIB, pods).resolve(container_of(request), CARDS).refusal is None


# --- the guard re-encodes without losing what it doesn't know -------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_guard_keeps_unknown_fields_when_it_rewrites() -> None:
    config = plugin_config(OTHER, [slice_of(A1)])
    # field 99 of ContainerConfig and field 42 of CreateContainerRequest don't exist (yet)
    unknown_config_field = b"\x9a\x06\x05later"
    config_bytes = config.SerializeToString() + unknown_config_field
    request = request_for(POD, allocation_of(worker=(slice_of(A0),)), cri_pb2.ContainerConfig())
    request.ClearField("config")
    raw = request.SerializeToString() + b"\x12" + varint(len(config_bytes)) + config_bytes + b"\xd0\x02\x07"
    guard = CreateContainerGuard(Resolver(GIB, None), lambda: CARDS, GIB, RewriteOptions())
    verdict = guard(raw)
    assert isinstance(verdict, Forward)
    out = verdict.message
    assert unknown_config_field in out and out.endswith(b"\xd0\x02\x07")
    decoded = cri_pb2.CreateContainerRequest.FromString(out)
    assert env_of(decoded.config)[ENV_VISIBLE_DEVICES] == [A0.uuid]


def test_guard_forwards_the_original_bytes_when_nothing_changes(caplog: pytest.LogCaptureFixture) -> None:
    request = request_for(POD, allocation_of(worker=(slice_of(A0),)), plugin_config(POD, [slice_of(A0)]))
    raw = request.SerializeToString() + b"\xd0\x02\x07"
    guard = CreateContainerGuard(Resolver(GIB, None), lambda: CARDS, GIB, RewriteOptions())
    with caplog.at_level(logging.INFO, logger="gpushare.enforcement.decide"):
        verdict = guard(raw)
    assert isinstance(verdict, Forward) and verdict.message is raw  # not even re-encoded
    assert [r.getMessage() for r in caplog.records] == [
        f"pod default/train container worker: card 0 ({A0.uuid}) as assigned (pod annotations)"
    ]


def test_guard_refuses_with_failed_precondition() -> None:
    request = request_for(POD, {}, plugin_config(POD, [slice_of(A0)]))
    guard = CreateContainerGuard(Resolver(GIB, None), lambda: CARDS, GIB, RewriteOptions())
    verdict = guard(request.SerializeToString())
    assert isinstance(verdict, Refuse)
    assert verdict.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "pod default/train container worker" in verdict.message


def test_a_card_of_a_model_the_pod_refuses_is_refused() -> None:
    mine = {"worker": (slice_of(T4, 10),)}
    pod = pod_dict("train", "uid-train", mine, mem=10)
    pod["metadata"]["annotations"][ANN_GPU_MODEL] = "A100"
    pods = FakePods([pod])
    sandbox_annotations = {**allocation_of(**mine), ANN_GPU_MODEL: "A100"}
    request = request_for(POD, sandbox_annotations, plugin_config(POD, [slice_of(T4, 10)], pod_mem=10))
    found = Resolver(GIB, pods).resolve(container_of(request), CARDS)
    assert found.refusal is not None and found.refusal.reason == "card-rule"
    assert found.refusal.message == (
        f"pod default/train container worker: card 2 ({T4.uuid}) is a T4 card; the pod takes only A100 cards"
    )
    outcome = rewrite_config(request.config, found, CARDS, GIB, RewriteOptions())
    assert outcome.refusal is found.refusal
    # read from the API when the sandbox's copy of the annotation can't be read: the same refusal
    request = request_for(POD, {**allocation_of(**mine), ANN_GPU_MODEL: "|"}, request.config)
    assert Resolver(GIB, pods).resolve(container_of(request), CARDS).refusal.reason == "card-rule"
