"""The NRI plugin's decisions without a runtime: CreateContainer answered with the CRI shim's decision as
an NRI adjustment or a refusal, the pod's limits set and cleared, and Synchronize's evictions."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from gpushare.nriplugin.handler import EVENT_EVICTED, EVENTS, LIMIT_EVENTS, Handler
from gpushare.nriplugin.session import ContainerRefused
from support.cri import plain_config, plugin_config
from support.crishim import A0, A1, CARDS, POD, FakePods, allocation_of, slice_of
from support.draclaims import claim, claim_pod, result
from support.nrimsg import adjusted_env, nri_container, nri_pod

from gpushare.cards import ENFORCED
from gpushare.contract.dra import format_claim_env_key
from gpushare.contract.names import (
    CTR_ANN_CARDS,
    CTR_ANN_POD_UID,
    ENV_VISIBLE_DEVICES,
    VISIBLE_DEVICES_VOID,
    device_file,
)
from gpushare.contract.units import GIB
from gpushare.enforcement.container import Target
from gpushare.enforcement.decide import Enforcer
from gpushare.enforcement.resolve import Resolver
from gpushare.memlimits.cgroups import V2 as CGROUP_V2
from gpushare.memlimits.cgroups import CgroupLayout
from gpushare.memlimits.enforcer import NO_HARD_LIMIT, PodLimiter
from gpushare.pb import nri_pb2
from gpushare.settings import RewriteOptions

T = TypeVar("T")
POD_CGROUP = "/kubepods/poduid-train"
ENFORCING = [replace(c, memory_limits=ENFORCED) if c in (A0, A1) else c for c in CARDS]
SIDECAR = Target(POD.namespace, POD.pod, POD.uid, "sidecar")


def run(call: Awaitable[T]) -> T:
    return asyncio.run(asyncio.wait_for(call, 10))  # type: ignore[arg-type]


class Node:
    """The handler with what it acts on recorded: the limits the driver set, the containers evicted, the
    Events and the device nodes added."""

    def __init__(self, tmp_path: Path, pods: FakePods | None = None, options: RewriteOptions | None = None) -> None:
        self.root = tmp_path
        (tmp_path / POD_CGROUP.lstrip("/")).mkdir(parents=True)
        self.limits: list[tuple[str, Path, int, int]] = []
        self.evicted: list[str] = []
        self.events: list[tuple[Target, str, str, str]] = []
        limiter = PodLimiter(lambda *limit: self.limits.append(limit), CgroupLayout(CGROUP_V2, tmp_path), GIB)
        enforcer = Enforcer(
            Resolver(GIB, pods),
            lambda: ENFORCING,
            GIB,
            options or RewriteOptions(),
            lambda *e: self.events.append(e),
            limiter,
        )
        self.handler = Handler(enforcer, self.evicted.append, limiting=True, device_node=self.node)

    @staticmethod
    def node(path: str) -> nri_pb2.LinuxDevice:
        digits = path.removeprefix("/dev/nvidia")
        return nri_pb2.LinuxDevice(path=path, type="c", major=195, minor=int(digits) if digits.isdigit() else 255)

    def create(self, annotations: dict[str, str], container: nri_pb2.Container, sandbox: str = "sb") -> Any:
        pod = nri_pod(POD, annotations, sandbox, POD_CGROUP)
        return run(self.handler.create_container(nri_pb2.CreateContainerRequest(pod=pod, container=container)))


def test_it_subscribes_to_container_creation_and_starts_and_the_ends_of_sandboxes(tmp_path: Path) -> None:
    handler = Node(tmp_path).handler
    assert not handler.registered
    assert set(run(handler.configure(nri_pb2.ConfigureRequest(), None))) == LIMIT_EVENTS  # type: ignore[arg-type]
    assert nri_pb2.START_CONTAINER in LIMIT_EVENTS
    assert handler.registered
    run(handler.shutdown())
    assert not handler.registered
    # where no card enforces limits, starts are not worth a round trip
    unlimited = Handler(handler._enforcer, [].append, limiting=False)
    assert set(run(unlimited.configure(nri_pb2.ConfigureRequest(), None))) == EVENTS  # type: ignore[arg-type]


CONTAINER_CGROUP = f"{POD_CGROUP}/ctr-1"


def start(node: Node, container: nri_pb2.Container) -> None:
    pod = nri_pod(POD, allocation_of(worker=(slice_of(A0, 8),)), "sb", POD_CGROUP)
    run(node.handler.start_container(pod, container))


def test_a_gpu_containers_own_cgroup_is_capped_at_its_share_as_it_starts(tmp_path: Path) -> None:
    node = Node(tmp_path)
    (tmp_path / CONTAINER_CGROUP.lstrip("/")).mkdir()
    start(node, nri_container(plugin_config(POD, [slice_of(A0, 8)]), cgroups_path=CONTAINER_CGROUP))
    assert node.limits == [(A0.uuid, tmp_path / CONTAINER_CGROUP.lstrip("/"), 0, 8 << 30)]  # no guarantee there


def test_a_container_start_the_driver_cannot_limit_is_refused_naming_pod_container_and_card(tmp_path: Path) -> None:
    node = Node(tmp_path)
    container = nri_container(plugin_config(POD, [slice_of(A0, 8)]), cgroups_path="")
    with pytest.raises(ContainerRefused) as refused:
        start(node, container)
    assert f"pod {POD.pod_key} container worker" in str(refused.value) and A0.uuid in str(refused.value)
    assert node.limits == []
    assert node.events[-1][1] == "GPUAssignmentRefused"


def test_a_container_without_a_gpu_starts_without_a_call_to_the_driver(tmp_path: Path) -> None:
    node = Node(tmp_path)
    start(node, nri_container(plain_config(("PATH", "/bin")), "side", cgroups_path=CONTAINER_CGROUP))
    assert node.limits == [] and node.events == []


def test_the_device_plugins_wrong_card_is_replaced_by_the_assigned_one(tmp_path: Path) -> None:
    node = Node(tmp_path)
    answer = node.create(allocation_of(worker=(slice_of(A0),)), nri_container(plugin_config(POD, [slice_of(A1)])))
    env = adjusted_env(answer)
    assert env[ENV_VISIBLE_DEVICES] == A0.uuid
    assert answer.adjust.annotations[CTR_ANN_CARDS] == A0.uuid
    assert answer.adjust.annotations[CTR_ANN_POD_UID] == POD.uid
    assert not answer.adjust.linux.devices  # device nodes are left alone unless asked
    assert node.events[0][1] == "GPUAssignmentCorrected" and A1.uuid in node.events[0][2]
    # and the pod's cgroup got its share of the card before the container is created
    assert node.limits == [(A0.uuid, tmp_path / POD_CGROUP.lstrip("/"), 20 << 30, 20 << 30)]


def test_a_container_given_what_was_assigned_is_not_adjusted(tmp_path: Path) -> None:
    answer = Node(tmp_path).create(
        allocation_of(worker=(slice_of(A0),)), nri_container(plugin_config(POD, [slice_of(A0)]))
    )
    assert answer == nri_pb2.CreateContainerResponse()


def test_device_nodes_are_swapped_by_path_when_asked(tmp_path: Path) -> None:
    node = Node(tmp_path, options=RewriteOptions(rewrite_devices=True))
    answer = node.create(allocation_of(worker=(slice_of(A0),)), nri_container(plugin_config(POD, [slice_of(A1)])))
    paths = [d.path for d in answer.adjust.linux.devices]
    assert paths[0] == f"-{device_file(A1.minor)}"  # removed first
    assert device_file(A0.minor) in paths and all(d.major == 195 for d in answer.adjust.linux.devices[1:])


def test_a_container_requesting_no_gpu_that_sets_all_sees_void(tmp_path: Path) -> None:
    node = Node(tmp_path)
    container = nri_container(plain_config(("A", "b"), (ENV_VISIBLE_DEVICES, "all")))
    answer = node.create(allocation_of(worker=(slice_of(A0),)), container)
    assert adjusted_env(answer) == {ENV_VISIBLE_DEVICES: VISIBLE_DEVICES_VOID}
    assert node.limits == []


def test_a_container_without_an_assignment_is_refused_naming_its_pod(tmp_path: Path) -> None:
    node = Node(tmp_path)
    with pytest.raises(ContainerRefused, match="pod default/train container worker"):
        node.create({}, nri_container(plugin_config(POD, [slice_of(A0)])))
    assert node.events[0][1] == "GPUAssignmentRefused"


def test_a_claims_container_is_recognised_by_the_variable_its_claims_cdi_spec_set(tmp_path: Path) -> None:
    """containerd 2.2 shows NRI no CDI names: the claim's marker in the env is what tells a DRA container,
    and a marker of a claim the pod doesn't have refuses it rather than passing it as a GPU-less one."""
    uid = "0b5c9f1e-1111-2222-3333-444455556666"
    marker = f"{format_claim_env_key(uid, 'gpu')}={A1.uuid}"
    container = nri_container(plain_config(("A", "b")), "ctr-1", "sb", nri_pb2.CONTAINER_UNKNOWN, marker)
    container.name = POD.container
    with pytest.raises(ContainerRefused, match=f"gpu.gpushare.io/claim={uid}-gpu"):
        Node(tmp_path, FakePods([])).create({}, container)


def test_a_claims_container_gets_the_env_of_its_claims_card_from_the_marker_alone(tmp_path: Path) -> None:
    uid = "0b5c9f1e-1111-2222-3333-444455556666"
    first = claim(
        result(device="card-1", memory="8Gi"), name="first", uid=uid, namespace=POD.namespace, reserved_for=(POD.uid,)
    )
    pods = FakePods([claim_pod(POD.pod, POD.uid, ("first",), namespace=POD.namespace)], claims=[first])
    marker = f"{format_claim_env_key(uid, 'gpu')}={A1.uuid}"
    container = nri_container(
        plain_config((ENV_VISIBLE_DEVICES, "all")), "ctr-1", "sb", nri_pb2.CONTAINER_UNKNOWN, marker
    )
    container.name = POD.container
    env = adjusted_env(Node(tmp_path, pods).create({}, container))
    assert env[ENV_VISIBLE_DEVICES] == A1.uuid


def test_a_sandboxs_end_clears_its_pods_limits_unless_the_pod_runs_on_in_another(tmp_path: Path) -> None:
    node = Node(tmp_path)
    gpu = nri_container(plugin_config(POD, [slice_of(A0)]))
    node.create(allocation_of(worker=(slice_of(A0),)), gpu, sandbox="old")
    node.create(allocation_of(worker=(slice_of(A0),)), gpu, sandbox="new")
    node.limits.clear()
    run(node.handler.stop_pod_sandbox(nri_pod(POD, {}, "old", POD_CGROUP)))
    assert node.limits == []  # "new" still runs under them
    run(node.handler.stop_pod_sandbox(nri_pod(POD, {}, "new", POD_CGROUP)))
    cleared = tmp_path / POD_CGROUP.lstrip("/")
    assert sorted(node.limits) == sorted([(A0.uuid, cleared, 0, NO_HARD_LIMIT), (A1.uuid, cleared, 0, NO_HARD_LIMIT)])
    node.limits.clear()
    run(node.handler.remove_pod_sandbox(nri_pod(POD, {}, "new", POD_CGROUP)))
    assert len(node.limits) == 2  # clearing again is harmless: the runtime may remove without a stop


def test_synchronize_answers_at_once_and_then_evicts_the_misplaced(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = nri_pod(POD, allocation_of(worker=(slice_of(A0),)), "sb", POD_CGROUP)
    wrong = nri_container(plugin_config(POD, [slice_of(A1)]), "wrong", "sb")
    sidecar = nri_container(plain_config((ENV_VISIBLE_DEVICES, "all")), "sees-all", "sb")
    quiet = nri_container(plain_config((ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID)), "quiet", "sb")
    gone = nri_container(plugin_config(POD, [slice_of(A1)]), "gone", "sb", nri_pb2.CONTAINER_STOPPED)

    async def synchronize() -> list[Any]:
        updates = await node.handler.synchronize([pod], [wrong, sidecar, quiet, gone])
        await node.handler.audited()  # the check runs after the answer
        return list(updates)

    assert run(synchronize()) == []
    assert node.evicted == ["wrong", "sees-all"]
    assert [(e[1], e[0].container) for e in node.events] == [(EVENT_EVICTED, "worker"), (EVENT_EVICTED, "sidecar")]
    assert A0.uuid in node.events[0][2] and A1.uuid in node.events[0][2]
    # the running pod got its limits again
    assert node.limits == [(A0.uuid, tmp_path / POD_CGROUP.lstrip("/"), 20 << 30, 20 << 30)]
