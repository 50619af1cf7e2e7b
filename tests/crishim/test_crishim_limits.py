"""The CRI shim holds a GPU pod to its share of each card before the pod's GPU container is created:
the driver's limit goes on the pod's cgroup, on the cards that enforce limits, and a limit the driver
doesn't set refuses the container."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from gpushare.crishim.reconcile import cgroup_parent
from gpushare.crishim.resolve import Resolver
from gpushare.crishim.server import CreateContainerGuard
from gpushare.crishim.splice import Forward, Refuse
from support.cri import plugin_config, request_for
from support.crishim import A0, A1, CARDS, POD, FakePods, allocation_of, pod_dict, slice_of

from gpushare.cards import ENFORCED
from gpushare.contract.units import GIB
from gpushare.gpus.backend import MemoryLimitError
from gpushare.memlimits.cgroups import V2 as CGROUP_V2
from gpushare.memlimits.cgroups import CgroupLayout
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.settings import RewriteOptions

ROOT = Path("/sys/fs/cgroup")
POD_CGROUP = "/kubepods/burstable/poduid-train"
#: A0 and A1 enforce limits; the T4 doesn't (an older driver would say why)
V2 = CgroupLayout(CGROUP_V2, ROOT)
ENFORCING = [replace(c, memory_limits=ENFORCED) if c in (A0, A1) else c for c in CARDS]


class Driver:
    """Records the limits set; refuses with ``refusal`` when given one."""

    def __init__(self, refusal: str = "") -> None:
        self.set: list[tuple[str, Path, int, int]] = []
        self.refusal = refusal

    def __call__(self, uuid: str, cgroup: Path, soft: int, hard: int) -> None:
        if self.refusal:
            raise MemoryLimitError(self.refusal)
        self.set.append((uuid, cgroup, soft, hard))


def guard(driver: Driver, pods: FakePods | None = None, layout: CgroupLayout = V2) -> CreateContainerGuard:
    limiter = PodLimiter(driver, layout, GIB)
    return CreateContainerGuard(Resolver(GIB, pods), lambda: ENFORCING, GIB, RewriteOptions(), None, limiter)


def create(slices: tuple, cgroup: str = POD_CGROUP, **others: tuple) -> bytes:
    request = request_for(POD, allocation_of(worker=slices, **others), plugin_config(POD, list(slices)))
    request.sandbox_config.linux.cgroup_parent = cgroup
    return request.SerializeToString()


def test_the_pods_cgroup_gets_its_share_of_each_enforcing_card_before_the_container_is_created() -> None:
    driver = Driver()
    verdict = guard(driver)(create((slice_of(A0, 8), slice_of(A1, 20))))
    assert isinstance(verdict, Forward)
    pod = ROOT / "kubepods" / "burstable" / "poduid-train"
    assert driver.set == [(A0.uuid, pod, 8 << 30, 8 << 30), (A1.uuid, pod, 20 << 30, 20 << 30)]


def test_the_pods_other_containers_count_toward_its_limit() -> None:
    driver = Driver()
    guard(driver)(create((slice_of(A0, 8),), sidecar=(slice_of(A0, 4),)))
    assert driver.set == [(A0.uuid, ROOT / "kubepods/burstable/poduid-train", 12 << 30, 12 << 30)]


def test_the_pod_from_the_api_counts_by_the_nodes_rule() -> None:
    driver = Driver()
    pods = FakePods([pod_dict("train", "uid-train", {"worker": (slice_of(A0, 8),)}, mem=8)])
    guard(driver, pods)(create((slice_of(A0, 8),)))
    assert [(uuid, hard) for uuid, _, _, hard in driver.set] == [(A0.uuid, 8 << 30)]


def test_a_whole_card_or_a_card_without_enforcement_gets_no_limit() -> None:
    driver = Driver()
    t4 = CARDS[2]
    assert isinstance(guard(driver)(create((slice_of(A0, 80), slice_of(t4, 4)))), Forward)
    assert driver.set == []


def test_a_limit_the_driver_does_not_set_refuses_the_container_naming_pod_card_and_cause() -> None:
    verdict = guard(Driver("nvmlDeviceSetMemoryLimits_v1 failed: Insufficient Resources"))(create((slice_of(A0, 8),)))
    assert isinstance(verdict, Refuse) and verdict.code.name == "FAILED_PRECONDITION"
    assert "pod default/train container worker" in verdict.message
    assert f"card 0 ({A0.uuid})" in verdict.message and "Insufficient Resources" in verdict.message


@pytest.mark.parametrize(
    ("cgroup", "layout", "why"),
    [("", V2, "no cgroup of its own"), (POD_CGROUP, CgroupLayout("v1"), "no cgroup v2 hierarchy")],
)
def test_a_pod_without_a_cgroup_the_driver_can_limit_is_refused_not_run_unlimited(
    cgroup: str, layout: CgroupLayout, why: str
) -> None:
    verdict = guard(Driver(), layout=layout)(create((slice_of(A0, 8),), cgroup))
    assert isinstance(verdict, Refuse) and why in verdict.message and A0.uuid in verdict.message


def test_a_running_sandboxs_cgroup_is_read_from_the_runtimes_verbose_status() -> None:
    assert cgroup_parent('{"config": {"linux": {"cgroup_parent": "/kubepods/podx"}}}') == "/kubepods/podx"
    assert cgroup_parent("not json") == "" and cgroup_parent("") == ""
