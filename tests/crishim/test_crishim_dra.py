"""A container kubelet gave CDI devices of prepared ResourceClaims (kind gpu.gpushare.io/claim) gets
its GPU from its claims: the CRI shim forwards it as kubelet sent it, and refuses one that also gets
a GPU from the device plugin."""

from __future__ import annotations

import logging

import grpc
import pytest
from gpushare.crishim.metrics import REFUSALS
from gpushare.crishim.resolve import DRA_AND_DEVICE_PLUGIN, Resolver
from gpushare.crishim.server import CreateContainerGuard
from gpushare.crishim.splice import Forward, Refuse
from podfactory import container, gpu_pod
from support.cri import plain_config, plugin_config, request_for
from support.crishim import A0, CARDS, POD, FakePods, allocation_of, slice_of

from gpushare.contract.names import ENV_MEM_CONTAINER, ENV_VISIBLE_DEVICES
from gpushare.contract.units import GIB
from gpushare.pb import cri_pb2
from gpushare.settings import RewriteOptions

CLAIM_DEVICE = "gpu.gpushare.io/claim=0b5c9f1e-1111-2222-3333-444455556666-gpu"


def with_claim(config: cri_pb2.ContainerConfig, annotated: bool = False) -> cri_pb2.ContainerConfig:
    """``config`` as kubelet sends it for a container using a prepared claim: the claim's CDI device
    in the CRI field (kubelet 1.31 and later) or in a CDI annotation (before)."""
    if annotated:
        config.annotations["cdi.k8s.io/gpu.gpushare.io_claim"] = CLAIM_DEVICE
    else:
        config.CDI_devices.append(cri_pb2.CDIDevice(name=CLAIM_DEVICE))
    return config


def guard(pods: FakePods | None = None) -> CreateContainerGuard:
    return CreateContainerGuard(Resolver(GIB, pods), lambda: CARDS, GIB, RewriteOptions())


def worker(*env: tuple[str, str]) -> cri_pb2.ContainerConfig:
    config = plain_config(*env)
    config.metadata.name = POD.container
    return config


@pytest.mark.parametrize("annotated", [False, True], ids=["cdi-field", "cdi-annotation"])
def test_a_claims_container_is_forwarded_as_kubelet_sent_it_not_voided(
    annotated: bool, caplog: pytest.LogCaptureFixture
) -> None:
    raw = request_for(POD, {}, with_claim(worker(("A", "b")), annotated)).SerializeToString()
    with caplog.at_level(logging.INFO, logger="gpushare.crishim.server"):
        verdict = guard()(raw)
    assert isinstance(verdict, Forward) and verdict.message is raw
    assert [r.getMessage() for r in caplog.records] == [
        f"pod default/train container worker: GPU from its ResourceClaims (CDI device(s) {CLAIM_DEVICE}), "
        "forwarded as kubelet sent it"
    ]


def test_a_container_given_a_claim_and_the_device_plugins_gpu_is_refused() -> None:
    config = with_claim(plugin_config(POD, [slice_of(A0)]))
    before = REFUSALS.labels(DRA_AND_DEVICE_PLUGIN)._value.get()
    verdict = guard()(request_for(POD, allocation_of(worker=(slice_of(A0),)), config).SerializeToString())
    assert isinstance(verdict, Refuse) and verdict.code == grpc.StatusCode.FAILED_PRECONDITION
    assert verdict.message == (
        f"pod default/train container worker: gets GPUs both through ResourceClaims (CDI device(s) {CLAIM_DEVICE}) "
        "and through the device plugin (aliyun.com/gpu-mem or aliyun.com/gpu-count); a container gets its GPU one "
        "way: drop its claim or its gpushare resource request"
    )
    assert REFUSALS.labels(DRA_AND_DEVICE_PLUGIN)._value.get() == before + 1


@pytest.mark.parametrize("mem", [8, 0], ids=["requests-gpu-mem", "requests-none"])
def test_the_device_plugins_env_alone_is_checked_against_the_pods_spec(mem: int) -> None:
    """Only the original plugin's env, which a pod spec can set too: the spec says whether the
    container also asked the device plugin for a GPU."""
    pods = FakePods([gpu_pod("train", [container("worker", mem)], node="node-a", uid=POD.uid, phase="Running")])
    raw = request_for(POD, {}, with_claim(worker((ENV_MEM_CONTAINER, "8")))).SerializeToString()
    verdict = guard(pods)(raw)
    if mem:
        assert isinstance(verdict, Refuse) and "gets GPUs both through ResourceClaims" in verdict.message
    else:
        assert isinstance(verdict, Forward) and verdict.message is raw
    assert pods.asked == [("default", "train")]


def test_the_device_plugins_env_alone_without_api_lookups_is_refused_not_guessed() -> None:
    raw = request_for(POD, {}, with_claim(worker((ENV_MEM_CONTAINER, "8"))))
    verdict = guard()(raw.SerializeToString())
    assert isinstance(verdict, Refuse)
    assert verdict.message == (
        f"pod default/train container worker: has CDI device(s) {CLAIM_DEVICE} of ResourceClaims and the device "
        f"plugin's env {ENV_MEM_CONTAINER}, which only its pod spec can explain, and API lookups are disabled "
        "(--no-api-fetch)"
    )


def test_a_cdi_device_of_another_kind_is_no_claim() -> None:
    config = worker()
    config.CDI_devices.append(cri_pb2.CDIDevice(name="gpu.gpushare.io/gpu=0"))
    verdict = guard()(request_for(POD, {}, config).SerializeToString())
    assert isinstance(verdict, Forward)
    decoded = cri_pb2.CreateContainerRequest.FromString(verdict.message)
    assert [kv.value for kv in decoded.config.envs if kv.key == ENV_VISIBLE_DEVICES] == ["void"]
