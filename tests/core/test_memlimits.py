"""Which cgroup a container is in and what its GPU memory limits are, decided without I/O."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.cards import ENFORCED, NOT_REPORTED, Card
from gpushare.contract.errors import AnnotationError
from gpushare.contract.inventory import format_inventory, parse_inventory
from gpushare.contract.units import GIB, MIB_BYTES, MemoryUnit
from gpushare.memlimits.cgroups import HYBRID, V1, V2, cgroup_dir, detect_layout, given_root, unified_path
from gpushare.memlimits.policy import pod_limits

# /proc/self/mountinfo lines, as each layout shows them
CGROUP2 = "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
HYBRID_MOUNTS = (
    "35 24 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n"
    "36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw\n"
    "38 35 0:33 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,memory\n"
)
V1_MOUNTS = "38 35 0:33 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,memory\n"
A100 = Card(0, "GPU-a", "A100-SXM4-80GB", 81920, 0)
T4 = Card(1, "GPU-t", "T4", 15360, 1)


def test_the_layout_is_read_from_the_mount_table() -> None:
    assert detect_layout(CGROUP2).version == V2 and detect_layout(CGROUP2).unified == Path("/sys/fs/cgroup")
    hybrid = detect_layout(HYBRID_MOUNTS)
    assert hybrid.version == HYBRID and hybrid.unified == Path("/sys/fs/cgroup/unified")
    assert detect_layout(V1_MOUNTS).version == V1 and detect_layout(V1_MOUNTS).unified is None
    assert detect_layout(CGROUP2).why_not is None
    assert "cgroup hybrid" in str(hybrid.why_not) and "cgroup v2" in str(hybrid.why_not)


def test_a_named_root_counts_only_when_it_is_a_cgroup2_mount() -> None:
    assert given_root(Path("/sys/fs/cgroup/unified"), HYBRID_MOUNTS).why_not is None
    assert given_root(Path("/sys/fs/cgroup/unified"), HYBRID_MOUNTS).unified == Path("/sys/fs/cgroup/unified")
    wrong = given_root(Path("/sys/fs/cgroup"), HYBRID_MOUNTS)
    assert wrong.unified is None and "--cgroup-root /sys/fs/cgroup is not a cgroup2 mount" in str(wrong.why_not)


def test_this_machines_own_layout_is_recognised() -> None:
    layout = detect_layout(Path("/proc/self/mountinfo").read_text())
    assert layout.version in (V2, HYBRID, V1)


@pytest.mark.parametrize(
    ("cgroups_path", "expected"),
    [
        ("/kubepods/burstable/pod1234/abc", "kubepods/burstable/pod1234/abc"),
        ("/k8s.io/abc", "k8s.io/abc"),
        (
            "kubepods-burstable-pod1234.slice:cri-containerd:abc",
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-abc.scope",
        ),
        ("system.slice:cri-containerd:abc", "system.slice/cri-containerd-abc.scope"),
    ],
)
def test_a_runtime_specs_cgroup_is_found_under_the_v2_root(cgroups_path: str, expected: str) -> None:
    assert cgroup_dir(Path("/sys/fs/cgroup"), cgroups_path) == Path("/sys/fs/cgroup") / expected


@pytest.mark.parametrize("bad", ["relative/path", "/a/../../etc", "kubepods:cri-containerd:abc"])
def test_a_cgroup_path_that_could_leave_the_hierarchy_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=r"cgroupsPath|slice"):
        cgroup_dir(Path("/sys/fs/cgroup"), bad)


def test_the_v2_line_of_proc_cgroup_names_the_cgroup() -> None:
    text = "12:memory:/k8s.io/abc\n1:name=systemd:/k8s.io/abc\n0::/k8s.io/abc\n"
    assert unified_path(text) == "/k8s.io/abc"
    assert unified_path("12:memory:/x\n") is None


def test_a_shared_card_is_capped_at_the_pods_share_and_guaranteed_all_of_it() -> None:
    (limit,) = pod_limits({A100.uuid: 8}, (A100, T4), GIB)
    assert (limit.uuid, limit.hard_bytes, limit.soft_bytes) == (A100.uuid, 8 << 30, 8 << 30)


def test_each_shared_card_of_a_two_card_pod_gets_its_own_limit_and_a_whole_card_none() -> None:
    limits = pod_limits({T4.uuid: 15, A100.uuid: 20}, (A100, T4), GIB)
    assert [(limit.uuid, limit.hard_bytes) for limit in limits] == [(A100.uuid, 20 << 30)]  # 15 GiB is the whole T4


def test_the_unit_sets_the_bytes() -> None:
    (limit,) = pod_limits({T4.uuid: 3}, (T4,), MemoryUnit(512))
    assert limit.hard_bytes == 3 * 512 * MIB_BYTES


def test_a_card_off_the_node_is_an_error() -> None:
    with pytest.raises(ValueError, match="GPU-x"):
        pod_limits({"GPU-x": 1}, (A100,), GIB)


def test_the_inventory_says_per_card_whether_limits_are_enforced() -> None:
    cards = (Card(0, "GPU-a", "A100", 81920, 0, memory_limits=ENFORCED), Card(1, "GPU-b", "T4", 15360, 1))
    parsed = parse_inventory(format_inventory(cards, GIB), "n1").cards
    assert [c.memory_limits for c in parsed] == [ENFORCED, NOT_REPORTED]
    assert parsed[0].limits_enforced and not parsed[1].limits_enforced
    older = format_inventory(cards, GIB).replace(',"memoryLimits":"enforced"', "")
    assert parse_inventory(older, "n1").cards[0].memory_limits == NOT_REPORTED
    with pytest.raises(AnnotationError, match=r"node n1.*memoryLimits"):
        parse_inventory(format_inventory(cards, GIB).replace('"enforced"', '" "'), "n1")


def test_a_node_agent_without_its_cri_shim_claims_no_limits_whatever_the_node_can_do() -> None:
    from gpushare.node import NO_SHIM_LIMITS
    from gpushare.settings import NodeSettings

    settings = NodeSettings("n1", None, "nvml", Path("/x"), GIB, frozenset(), limits_off=NO_SHIM_LIMITS)
    assert settings.cgroup_layout().why_not == NO_SHIM_LIMITS
    assert settings.cgroup_layout().unified is None
