"""A container kubelet gave CDI devices of prepared ResourceClaims (kind gpu.gpushare.io/claim) gets
its GPU from its claims: the CRI shim sets the env of every card they give it, and refuses one that
also gets a GPU from the device plugin, one whose CDI device names no claim of its pod, and a second
pod on a claim another pod holds."""

from __future__ import annotations

import logging

import grpc
import pytest
from gpushare.crishim.metrics import REFUSALS
from gpushare.crishim.server import CreateContainerGuard
from gpushare.crishim.splice import Forward, Refuse
from podfactory import container, gpu_pod
from support.cri import env_of, plain_config, plugin_config, request_for
from support.crishim import A0, A1, CARDS, POD, FakePods, allocation_of, slice_of
from support.draclaims import claim, claim_pod, result

from gpushare.contract.names import ENV_MEM_CONTAINER, ENV_MEM_DEV, ENV_MEM_IDX, ENV_MEM_POD, ENV_VISIBLE_DEVICES
from gpushare.contract.units import GIB
from gpushare.enforcement.resolve import DRA_AND_DEVICE_PLUGIN, DRA_CLAIM, Resolver
from gpushare.pb import cri_pb2
from gpushare.settings import RewriteOptions

UID_1 = "0b5c9f1e-1111-2222-3333-444455556666"
UID_2 = "0b5c9f1e-1111-2222-3333-777788889999"
CLAIM_DEVICE = f"gpu.gpushare.io/claim={UID_1}-gpu"


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


def train_claim(name: str, uid: str, *results: dict, reserved_for: tuple[str, ...] = (POD.uid,)) -> dict:
    return claim(*(results or (result(),)), name=name, uid=uid, namespace=POD.namespace, reserved_for=reserved_for)


def train_pods(*claims: dict, names: tuple[str, ...] = ("first",)) -> FakePods:
    """Pod default/train, whose worker uses the claims ``names``, and those ResourceClaims."""
    return FakePods([claim_pod(POD.pod, POD.uid, names, namespace=POD.namespace)], claims=claims)


def forwarded_env(verdict: object) -> dict[str, list[str]]:
    assert isinstance(verdict, Forward), verdict
    return env_of(cri_pb2.CreateContainerRequest.FromString(verdict.message).config)


@pytest.mark.parametrize("annotated", [False, True], ids=["cdi-field", "cdi-annotation"])
def test_a_claims_container_gets_the_env_of_its_claims_card_whatever_its_spec_says(
    annotated: bool, caplog: pytest.LogCaptureFixture
) -> None:
    pods = train_pods(train_claim("first", UID_1, result(device="card-1", memory="8Gi")))
    config = with_claim(worker(("A", "b"), (ENV_VISIBLE_DEVICES, "all")), annotated)
    with caplog.at_level(logging.INFO, logger="gpushare.enforcement.decide"):
        env = forwarded_env(guard(pods)(request_for(POD, {}, config).SerializeToString()))
    assert env == {
        "A": ["b"],
        ENV_VISIBLE_DEVICES: [A1.uuid],
        ENV_MEM_IDX: ["1"],
        ENV_MEM_POD: ["8"],
        ENV_MEM_CONTAINER: ["8"],
        ENV_MEM_DEV: ["80"],
    }
    assert [r.getMessage() for r in caplog.records] == [
        f"pod default/train container worker: GPU from its ResourceClaims (CDI device(s) {CLAIM_DEVICE}): "
        f"NVIDIA_VISIBLE_DEVICES={A1.uuid} ALIYUN_COM_GPU_MEM_IDX=1 ALIYUN_COM_GPU_MEM_POD=8 "
        "ALIYUN_COM_GPU_MEM_CONTAINER=8 ALIYUN_COM_GPU_MEM_DEV=80"
    ]


def test_a_container_with_two_claims_sees_every_card_they_give_it_with_the_sums() -> None:
    """Each claim's CDI spec names only its own cards, and containerd keeps the last device's value of a
    variable: the env of all of them is the shim's to set."""
    pods = train_pods(
        train_claim("first", UID_1, result(device="card-0", memory="8Gi")),
        train_claim(
            "second",
            UID_2,
            result(device="card-1", memory="8Gi", request="a"),
            result(device="card-0", memory="4Gi", request="b"),
            result(device="card-2", memory="2Gi", request="unused"),
        ),
        names=("first", "second"),
    )
    config = worker()
    config.CDI_devices.extend(
        cri_pb2.CDIDevice(name=f"gpu.gpushare.io/claim={uid}-{request}")
        for uid, request in ((UID_1, "gpu"), (UID_2, "a"), (UID_2, "b"))
    )
    env = forwarded_env(guard(pods)(request_for(POD, {}, config).SerializeToString()))
    assert env[ENV_VISIBLE_DEVICES] == [f"{A0.uuid},{A1.uuid}"]
    assert env[ENV_MEM_IDX] == ["0,1"]
    assert env[ENV_MEM_CONTAINER] == ["20"]  # 8 + 4 on card 0, 8 on card 1
    assert env[ENV_MEM_POD] == ["22"]  # what the pod's claims hold here, the request no container uses too


@pytest.mark.parametrize(
    ("device", "why"),
    [
        (
            f"gpu.gpushare.io/claim={UID_2}-gpu",
            f"CDI device gpu.gpushare.io/claim={UID_2}-gpu names no ResourceClaim of pod default/train (its claims: "
            f"default/first (uid {UID_1}))",
        ),
        (
            f"gpu.gpushare.io/claim={UID_1}-other",
            f"CDI device gpu.gpushare.io/claim={UID_1}-other: ResourceClaim default/first (uid {UID_1}) has no request "
            "other allocated a card of node node-a",
        ),
    ],
    ids=["another-pods-claim", "no-such-request"],
)
def test_a_cdi_device_naming_no_claim_of_the_pod_is_refused_naming_pod_container_and_device(
    device: str, why: str
) -> None:
    pods = train_pods(train_claim("first", UID_1))
    pods.claims["theirs"] = train_claim("theirs", UID_2, reserved_for=("uid-other",))
    config = worker()
    config.CDI_devices.extend([cri_pb2.CDIDevice(name=CLAIM_DEVICE), cri_pb2.CDIDevice(name=device)])
    before = REFUSALS.labels(DRA_CLAIM)._value.get()
    verdict = guard(pods)(request_for(POD, {}, config).SerializeToString())
    assert isinstance(verdict, Refuse) and verdict.code == grpc.StatusCode.FAILED_PRECONDITION
    assert verdict.message == f"pod default/train container worker: {why}"
    assert REFUSALS.labels(DRA_CLAIM)._value.get() == before + 1


def test_a_claim_shared_by_two_pods_serves_the_first_one_only() -> None:
    """Two pods each limited to a shared claim's whole memory would fill its card past its memory: the
    claim's memory is one budget, so the second pod waits for the first."""
    shared = train_claim("first", UID_1, reserved_for=("uid-first-pod", POD.uid))
    verdict = guard(train_pods(shared))(request_for(POD, {}, with_claim(worker())).SerializeToString())
    assert isinstance(verdict, Refuse)
    assert verdict.message == (
        f"pod default/train container worker: ResourceClaim default/first (uid {UID_1}) is in use by pod "
        "default/pod-uid-first-pod (uid uid-first-pod) as well as pod default/train: a claim's GPU memory is one "
        "budget, used by one pod at a time; pod default/train waits until that pod is done (or give each pod its "
        "own claim, e.g. from a ResourceClaimTemplate)"
    )
    first = train_claim("first", UID_1, reserved_for=(POD.uid, "uid-second-pod"))
    assert forwarded_env(guard(train_pods(first))(request_for(POD, {}, with_claim(worker())).SerializeToString()))


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
    pod = gpu_pod("train", [container("worker", mem)], node="node-a", uid=POD.uid, phase="Running")
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "first"}]
    pods = FakePods([pod], claims=[train_claim("first", UID_1)])
    raw = request_for(POD, {}, with_claim(worker((ENV_MEM_CONTAINER, "8")))).SerializeToString()
    verdict = guard(pods)(raw)
    if mem:
        assert isinstance(verdict, Refuse) and "gets GPUs both through ResourceClaims" in verdict.message
    else:
        assert forwarded_env(verdict)[ENV_MEM_CONTAINER] == ["8"]  # the claim's, set once
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
