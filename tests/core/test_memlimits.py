"""Which cgroup a container is in and what its GPU memory limits are, decided without I/O."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.cards import ENFORCED, NOT_REPORTED, Card
from gpushare.contract.errors import AnnotationError
from gpushare.contract.inventory import format_inventory, parse_inventory
from gpushare.contract.units import GIB, MIB_BYTES, MemoryUnit
from gpushare.memlimits.cgroups import (
    HYBRID,
    V1,
    V2,
    CgroupLayout,
    cgroup_dir,
    detect_layout,
    given_root,
    kubepods_root,
    pod_cgroups,
    pod_uid_of,
    unified_path,
)
from gpushare.memlimits.enforcer import NO_HARD_LIMIT, PodLimiter
from gpushare.memlimits.policy import container_limits, guaranteed_bytes, pod_limits

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
#: an A100 whose driver keeps 512 MiB for itself
RESERVING = Card(0, "GPU-r", "A100-SXM4-80GB", 81920, 0, memory_limits=ENFORCED, reserved_mib=512)


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


def test_the_guarantee_is_the_pods_share_of_what_the_driver_does_not_keep() -> None:
    (limit,) = pod_limits({RESERVING.uuid: 40}, (RESERVING,), GIB)
    assert limit.hard_bytes == 40 << 30
    assert limit.soft_bytes == (81920 - 512) // 2 * MIB_BYTES  # half the card, half of what it can guarantee
    assert limit.soft_bytes % MIB_BYTES == 0


@pytest.mark.parametrize("shares", [[40, 40], [20, 20, 20, 20], [1] * 80, [7, 13, 29, 31], [79, 1]])
def test_soft_limits_on_a_full_card_never_add_up_past_what_it_can_guarantee(shares: list[int]) -> None:
    softs = [pod_limits({RESERVING.uuid: share}, (RESERVING,), GIB)[0].soft_bytes for share in shares]
    assert sum(softs) <= (RESERVING.memory_mib - RESERVING.reserved_mib) * MIB_BYTES
    assert sum(softs) >= (RESERVING.memory_mib - RESERVING.reserved_mib - len(shares)) * MIB_BYTES  # rounding only
    assert guaranteed_bytes(80 << 30, RESERVING) == (81920 - 512) * MIB_BYTES


def test_a_container_is_capped_at_its_own_share_with_no_guarantee() -> None:
    limits = container_limits({RESERVING.uuid: 8, T4.uuid: 15}, (RESERVING, T4), GIB)
    assert [(limit.uuid, limit.soft_bytes, limit.hard_bytes) for limit in limits] == [(RESERVING.uuid, 0, 8 << 30)]


def test_the_inventory_carries_what_the_driver_reserves_and_refuses_more_than_the_card() -> None:
    parsed = parse_inventory(format_inventory((RESERVING, T4), GIB), "n1").cards
    assert [c.reserved_mib for c in parsed] == [512, 0]
    older = format_inventory((RESERVING,), GIB).replace(',"reservedMiB":512', "")
    assert parse_inventory(older, "n1").cards[0].reserved_mib == 0
    with pytest.raises(AnnotationError, match=r"node n1.*card 0 reservedMiB 81920"):
        parse_inventory(format_inventory((RESERVING,), GIB).replace('"reservedMiB":512', '"reservedMiB":81920'), "n1")


UID = "0a1b2c3d-1111-2222-3333-444455556666"


@pytest.mark.parametrize(
    ("name", "uid"),
    [
        (f"pod{UID}", UID),
        (f"kubepods-burstable-pod{UID.replace('-', '_')}.slice", UID),
        (f"kubepods-pod{UID.replace('-', '_')}.slice", UID),
        ("cri-containerd-0123.scope", None),
        ("burstable", None),
        (f"xpod{UID}", None),
    ],
)
def test_a_pods_cgroup_is_known_by_kubelets_name_for_it(name: str, uid: str | None) -> None:
    assert pod_uid_of(name) == uid


def _limiter(tmp_path: Path, calls: list[tuple[str, Path, int, int]]) -> PodLimiter:
    return PodLimiter(lambda *call: calls.append(call), CgroupLayout(V2, tmp_path), GIB)


def test_a_containers_cgroup_is_made_when_asked_and_capped_at_its_share(tmp_path: Path) -> None:
    calls: list[tuple[str, Path, int, int]] = []
    (tmp_path / "kubepods" / "podu").mkdir(parents=True)
    why = _limiter(tmp_path, calls).apply_container(
        "pod ns/p container c", "/kubepods/podu/ctr1", {RESERVING.uuid: 8}, (RESERVING,), make=True
    )
    assert why is None
    assert (tmp_path / "kubepods" / "podu" / "ctr1").is_dir()
    assert calls == [(RESERVING.uuid, tmp_path / "kubepods" / "podu" / "ctr1", 0, 8 << 30)]


def test_a_container_whose_cgroup_is_not_there_and_not_to_be_made_is_refused_naming_it(tmp_path: Path) -> None:
    def refuse(uuid: str, cgroup: Path, soft: int, hard: int) -> None:
        from gpushare.memlimits.enforcer import MemoryLimitError

        raise MemoryLimitError("Not Found")

    limiter = PodLimiter(refuse, CgroupLayout(V2, tmp_path), GIB)
    why = limiter.apply_container("pod ns/p container c", "/kubepods/podu/ctr1", {RESERVING.uuid: 8}, (RESERVING,))
    assert why is not None and "pod ns/p container c" in why and RESERVING.uuid in why and "Not Found" in why


def test_clearing_a_pod_takes_the_limits_off_its_containers_first_then_the_pod(tmp_path: Path) -> None:
    calls: list[tuple[str, Path, int, int]] = []
    pod = tmp_path / "kubepods" / "podu"
    (pod / "ctr1").mkdir(parents=True)
    (pod / "ctr2").mkdir()
    assert _limiter(tmp_path, calls).clear("pod ns/p", "/kubepods/podu", (RESERVING, T4)) == []
    cleared = [(cgroup.name, soft, hard) for _, cgroup, soft, hard in calls]
    assert sorted(cleared[:2]) == [("ctr1", 0, NO_HARD_LIMIT), ("ctr2", 0, NO_HARD_LIMIT)]
    assert cleared[2:] == [("podu", 0, NO_HARD_LIMIT)]  # the T4 enforces none: one call per cgroup


def test_the_sweep_clears_the_pod_cgroups_of_ended_pods_only(tmp_path: Path) -> None:
    calls: list[tuple[str, Path, int, int]] = []
    burstable = tmp_path / "kubepods" / "burstable"
    running, ended, busy = (f"{UID[:-1]}{n}" for n in "012")
    for uid in (running, ended, busy):
        (burstable / f"pod{uid}" / "ctr").mkdir(parents=True)
    (tmp_path / "kubepods" / f"pod{UID}").mkdir()  # a Guaranteed pod, ended too
    (burstable / f"pod{busy}" / "cgroup.events").write_text("populated 1\nfrozen 0\n")  # a process runs there
    assert kubepods_root(burstable / f"pod{running}") == tmp_path / "kubepods"
    assert set(pod_cgroups([tmp_path / "kubepods"])) == {running, ended, busy, UID}
    cleared = _limiter(tmp_path, calls).sweep([], {running}, (RESERVING,))  # kubelet's default root
    assert sorted(cleared) == sorted([ended, UID])
    assert {cgroup for _, cgroup, _, _ in calls} == {
        burstable / f"pod{ended}" / "ctr",
        burstable / f"pod{ended}",
        tmp_path / "kubepods" / f"pod{UID}",
    }
    # under a root of kubelet's own, found beside the pods the runtime still lists
    elsewhere = f"{UID[:-1]}9"
    (tmp_path / "node-a" / "kubepods" / f"pod{elsewhere}").mkdir(parents=True)
    calls.clear()
    assert elsewhere in _limiter(tmp_path, calls).sweep([f"/node-a/kubepods/pod{running}"], {running}, (RESERVING,))
    assert (RESERVING.uuid, tmp_path / "node-a" / "kubepods" / f"pod{elsewhere}", 0, NO_HARD_LIMIT) in calls
