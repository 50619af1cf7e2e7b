"""gpushare on a machine with a real NVIDIA GPU: its NVML inventory against what the driver reports, its
memory-limit probe against what the machine is, and, where the driver enforces per-cgroup limits, CUDA
processes in cgroups limited as gpushare limits a pod and its containers. Every check skips, with one
line, where no NVIDIA driver is loaded; run them as CONTRIBUTING.md ("Testing on a real GPU") says. The
figures worth a report are printed at the end of the run (``conftest.py``).

What the driver reports is read without gpushare (nvidia-smi, /proc/driver/nvidia, sysfs, the cgroup
files), and every NVML or CUDA call runs in a child process given the real libnvidia-ml.so.1, never the
fake one (``machine.real_env``).

NVIDIA's NVML reference (nvmlSetMemoryLimits_v1_t,
https://docs.nvidia.com/deploy/nvml-api/api/structnvmlSetMemoryLimits__v1__t.html): the soft limit is
what is guaranteed before allocations may fail under memory pressure, the hard limit the most that can
be allocated; what is available in a cgroup is what nvmlDeviceGetMemoryInfo_v2 says when read in it;
soft 0 and hard NVML_DEVICE_MEMORY_LIMIT_MAX clear the limits, and so does removing the cgroup.
nvmlGetMemoryLimits_v1_t (https://docs.nvidia.com/deploy/nvml-api/api/structnvmlGetMemoryLimits__v1__t.html)
reads them back. MPS v3 Memory Partitioning
(https://docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html): past the hard limit an
allocation fails with out-of-memory; under the kernel's dmem controller the hard limit is dmem.max and
the soft one dmem.min; the driver picks its backend (dmem, or its own ``misc``) when it loads; set the
soft limit back to 0 before a cgroup is removed, or what the driver reserved for it on its ancestors is
never given back.

How gpushare limits a pod on a card: the pod's cgroup gets a hard limit of the pod's share and a soft
limit of what the card can guarantee of it; each GPU container's own cgroup gets a hard limit of its
share and soft 0; when the pod's sandbox ends, both are cleared before kubelet removes them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu import machine
from gpu.cudadriver import CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, MIB
from gpushare.cards import ENFORCED, Card
from gpushare.contract.units import GIB as GIB_UNIT
from gpushare.memlimits.enforcer import NO_HARD_LIMIT
from gpushare.memlimits.policy import Limit, container_limits, pod_limits
from gpushare.sandbox.nvmllimits import NO_LIMIT, memory_info, read_limits

# a mark rather than a module-level skip: pytest exits 0 with every test skipped, 5 with none collected
_WHY_NOT = machine.no_driver()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")

#: how far the memory a process sees may move while the checks run (the driver's own bookkeeping)
SLACK = 64 * MIB
#: both ways out-of-memory: cuMemAlloc and cuMemCreate past the cap
HELD = (CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY)


@pytest.fixture(scope="module")
def driver_cards() -> list[machine.SmiCard]:
    """The cards nvidia-smi lists, less those in MIG mode (which gpushare leaves out)."""
    return [card for card in machine.smi_cards() if not card.mig]


@pytest.fixture(scope="module")
def cards() -> list[dict]:
    """gpushare's inventory (``--gpus nvml``), each card as a dict of :class:`gpushare.cards.Card`."""
    return machine.inventory()


def test_inventory_is_what_the_driver_reports(driver_cards: list[machine.SmiCard], cards: list[dict]) -> None:
    for card in cards:
        machine.figure(
            f"card {card['index']} {card['uuid']}: {card['model']}, {card['memory_mib']} MiB, minor {card['minor']}, "
            f"NUMA {card['numa_node']}, {len(card['nvlink_peers'])} NVLink peers, limits: {card['memory_limits']}"
        )
    seen = [(c["index"], c["uuid"], c["model"], c["memory_mib"]) for c in cards]
    assert seen == [(c.index, c.uuid, c.name, c.memory_mib) for c in driver_cards]
    one_node = machine.numa_node_count() <= 1
    unseen = []
    for card, driver in zip(cards, driver_cards, strict=True):
        assert card["minor"] == machine.minor_of(driver), card["uuid"]
        shown, numa = machine.numa_of(driver.bus_id)
        if not shown:
            unseen.append(driver.bus_id)
            continue
        # sysfs says -1 where the platform names no node; on a one-node machine NVML may still say 0
        allowed = {numa} if numa is not None else ({None, 0} if one_node else {None})
        assert card["numa_node"] in allowed, f"{card['uuid']}: NUMA {card['numa_node']}, sysfs {numa}"
    if unseen:
        warnings.warn(f"NUMA nodes not compared: sysfs shows no {', '.join(unseen)}", stacklevel=1)


def test_reserved_memory_is_what_the_driver_reports(driver_cards: list[machine.SmiCard], cards: list[dict]) -> None:
    """What the driver keeps of each card for itself (nvmlMemory_v2_t.reserved), as gpushare reads it:
    the soft limits gpushare sets on a card add up to at most the card less this."""
    if any("reserved_mib" not in card for card in cards):
        pytest.skip("gpushare's inventory has no reserved_mib: the reserved memory is not compared")
    compared = {}
    for card, driver in zip(cards, driver_cards, strict=True):
        smi = "[N/A]" if driver.reserved_mib is None else f"{driver.reserved_mib} MiB"
        machine.figure(f"card {card['index']}: reserved {card['reserved_mib']} MiB (gpushare), {smi} (nvidia-smi)")
        if driver.reserved_mib is not None:
            compared[driver.index] = (card["reserved_mib"], driver.reserved_mib)
    if len(compared) < len(driver_cards):
        warnings.warn("reserved memory not compared where nvidia-smi says [N/A]", stacklevel=1)
    if not compared:
        pytest.skip("nvidia-smi reports no card's reserved memory ([N/A])")
    assert all(ours == smi for ours, smi in compared.values()), f"per card (gpushare, nvidia-smi): {compared}"


def _expected_probe() -> tuple[str, ...]:
    """What the node agent's probe may say here, from the machine alone: ``enforced``, or how the
    reason it gives starts. Its order is the probe's: the cgroups, the binding, the driver, NVML's answer."""
    if machine.cgroup_fs() != "cgroup2fs":
        return ("cgroup ",)  # cgroup v1 (...) or cgroup hybrid (...)
    if not machine.binding_has_limits():
        return ("the NVML binding predates per-cgroup memory limits",)
    if machine.driver_release() < machine.LIMITS_RELEASE:  # the driver lacks the call, sandboxed or not
        return ("the driver has no per-cgroup memory limits",)
    refused = "nvmlDeviceGetMemoryLimits_v1 failed: "  # NVML's answer, e.g. Insufficient Permissions
    if machine.sandboxed():
        return (refused,)
    return (ENFORCED,) if os.geteuid() == 0 else (ENFORCED, refused)


def test_memory_limit_probe_says_what_the_machine_is(cards: list[dict]) -> None:
    capacity = machine.dmem_capacity()
    machine.figure(
        f"driver {machine.driver_version()}, kernel {os.uname().release}, /sys/fs/cgroup {machine.cgroup_fs()}, "
        f"sandboxed: {machine.sandboxed() or 'no'}, dmem.capacity: "
        + ("absent" if capacity is None else "; ".join(capacity) or "no nvidia line")
    )
    expected = _expected_probe()
    for card in cards:
        said = card["memory_limits"]
        ok = any(said == e if e == ENFORCED else said.startswith(e) for e in expected)
        assert ok, f"card {card['index']}: the probe says {said!r}, expected {' or '.join(expected)}"


def _result(code: int) -> str:
    return {CUDA_SUCCESS: "ok", CUDA_ERROR_OUT_OF_MEMORY: "out of memory"}.get(code, f"CUresult {code}")


def _cuda_said(found: dict) -> str:
    said = f"cuMemGetInfo free {found['free'] >> 20} MiB of {found['total'] >> 20} MiB"
    for call, name in (("alloc", "cuMemAlloc"), ("create", "cuMemCreate")):
        said += f"; {name} {found['below'] >> 20} MiB {_result(found[f'{call}_below'])}"
        if f"{call}_past" in found:
            said += f", {found['past'] >> 20} MiB more {_result(found[f'{call}_past'])}"
    return said


def test_cuda_allocates_the_whole_card_without_a_limit(driver_cards: list[machine.SmiCard]) -> None:
    for card in driver_cards:
        found = machine.cuda(card.uuid, 0)
        machine.figure(f"card {card.index} without a limit: {_cuda_said(found)}")
        usable = card.memory_mib - (card.reserved_mib or 0)  # what the driver keeps for itself is not CUDA's
        assert usable * 0.99 <= found["total"] / MIB <= card.memory_mib, (card.uuid, found)
        assert found["alloc_below"] == CUDA_SUCCESS, (card.uuid, found)
        assert found["create_below"] == CUDA_SUCCESS, (card.uuid, found)


# --- limits, where the driver enforces them -------------------------------------------------------------


@pytest.fixture(scope="module")
def limited_card(cards: list[dict]) -> dict:
    """The first card whose driver enforces per-cgroup limits; the checks that set limits skip without
    one, or without root."""
    enforcing = [card for card in cards if card["memory_limits"] == ENFORCED]
    if not enforcing:
        said = "; ".join(f"card {c['index']}: {c['memory_limits']}" for c in cards) or "gpushare found no card"
        pytest.skip(f"memory limits not enforced: {said}")
    if os.geteuid() != 0:
        pytest.skip("not root: the test makes cgroups and sets limits (nvmlDeviceSetMemoryLimits_v1 needs root)")
    return enforcing[0]


def _gpushare_limits(card: dict) -> tuple[Limit, Limit]:
    """gpushare's limits for a pod holding 1 GiB of ``card`` in its one GPU container: its policy's for
    the pod's cgroup (hard the share, soft what the card can guarantee of it) and for the container's
    (hard the share, soft 0)."""
    held, cards = {card["uuid"]: 1}, [Card(**card | {"nvlink_peers": tuple(card["nvlink_peers"])})]
    ((pod,), (ctr,)) = (pod_limits(held, cards, GIB_UNIT), container_limits(held, cards, GIB_UNIT))
    return pod, ctr


def _limits_said(read: tuple[int, int] | str) -> str:
    if isinstance(read, str):
        return read
    soft, hard = read
    return f"soft {soft >> 20} MiB, hard " + ("none" if hard == NO_HARD_LIMIT else f"{hard >> 20} MiB")


def _test_cgroup(what: str) -> str:
    return f"gpushare-gpu-test-{os.getpid()}-{what}"


def _assert_held(found: dict, cap: int) -> None:
    # what the process may still allocate is within the cap (NVML's reference: memory info, read in the
    # cgroup, says what is actually available there; MPS v3: past the hard limit, out-of-memory)
    assert found["free"] <= cap, f"cuMemGetInfo shows no cap: {found}"
    assert (found["alloc_below"], found["create_below"]) == (CUDA_SUCCESS, CUDA_SUCCESS), found
    assert (found["alloc_past"], found["create_past"]) == HELD, found


def _set_said(limit: Limit) -> str:
    return f"set soft {limit.soft_bytes >> 20} MiB hard {limit.hard_bytes >> 20} MiB"


@dataclass(frozen=True, slots=True)
class LimitedPod:
    uuid: str
    pod: Path
    ctr: Path
    pod_limit: Limit
    ctr_limit: Limit


@pytest.fixture(scope="class")
def limited(limited_card: dict) -> Iterator[LimitedPod]:
    """A pod's cgroup with its one GPU container's cgroup below it, both limited as gpushare limits them
    before the container's process runs there."""
    pod_limit, ctr_limit = _gpushare_limits(limited_card)
    with machine.cgroup_tree(_test_cgroup("pod"), limited_card["uuid"]) as tree:
        pod = tree.make("pod")
        ctr = tree.make("pod/ctr")
        tree.limit(pod, pod_limit.soft_bytes, pod_limit.hard_bytes)
        tree.limit(ctr, ctr_limit.soft_bytes, ctr_limit.hard_bytes)
        yield LimitedPod(limited_card["uuid"], pod, ctr, pod_limit, ctr_limit)


class TestAPodLimitedAsGpushareLimitsIt:
    """gpushare's limits on a pod and its container (the ``limited`` fixture), for this class's checks
    alone: they are cleared and the cgroups removed before the checks below it run."""

    def test_the_driver_holds_the_limits_gpushare_set(self, limited: LimitedPod) -> None:
        env = machine.real_env()
        pod, ctr = read_limits(limited.pod, env)[limited.uuid], read_limits(limited.ctr, env)[limited.uuid]
        machine.figure(
            f"pod {_set_said(limited.pod_limit)}, read {_limits_said(pod)} ({machine.dmem_files(limited.pod)}); "
            f"container {_set_said(limited.ctr_limit)}, read {_limits_said(ctr)} ({machine.dmem_files(limited.ctr)})"
        )
        wanted = [(limit.soft_bytes, limit.hard_bytes) for limit in (limited.pod_limit, limited.ctr_limit)]
        assert [pod, ctr] == wanted, "limits read back (pod, container) against those set"

    def test_a_cuda_process_in_the_container_is_held_to_its_share(self, limited: LimitedPod) -> None:
        found = machine.cuda(limited.uuid, limited.ctr_limit.hard_bytes, limited.ctr)
        machine.figure(f"in a container of a limited pod: {_cuda_said(found)}")
        _assert_held(found, limited.ctr_limit.hard_bytes)

    def test_nvml_in_the_container_reports_its_cap(self, limited: LimitedPod) -> None:
        total, free = memory_info(limited.ctr, machine.real_env())[limited.uuid]
        said = f"nvmlDeviceGetMemoryInfo_v2 total {total >> 20} MiB, free {free >> 20} MiB"
        machine.figure(f"in a container of a limited pod: {said}")
        assert min(total, free) <= limited.ctr_limit.hard_bytes, f"NVML shows no cap: total {total}, free {free}"


def test_a_container_limited_alone_is_held(limited_card: dict) -> None:
    """Only the container's own cgroup limited: what holds a process under the driver's ``misc``
    backend, whose limits are not documented as hierarchical."""
    uuid, (_, limit) = limited_card["uuid"], _gpushare_limits(limited_card)
    with machine.cgroup_tree(_test_cgroup("ctr"), uuid) as tree:
        tree.make("pod")
        ctr = tree.make("pod/ctr")
        tree.limit(ctr, limit.soft_bytes, limit.hard_bytes)
        found = machine.cuda(uuid, limit.hard_bytes, ctr)
        machine.figure(f"container limited alone: {_cuda_said(found)}")
        _assert_held(found, limit.hard_bytes)


def test_whether_a_pod_limited_alone_holds_its_container(limited_card: dict) -> None:
    """Only the pod's cgroup limited, the process in a child of it: held under the kernel's dmem
    controller (a cgroup's usage counts its descendants'), not known under ``misc``. Reported, not
    required: it tells which backend the machine has."""
    uuid, (limit, _) = limited_card["uuid"], _gpushare_limits(limited_card)
    with machine.cgroup_tree(_test_cgroup("parent"), uuid) as tree:
        pod = tree.make("pod")
        ctr = tree.make("pod/ctr")
        tree.limit(pod, limit.soft_bytes, limit.hard_bytes)
        found = machine.cuda(uuid, limit.hard_bytes, ctr)
    held = (found["alloc_past"], found["create_past"]) == HELD
    capacity = machine.dmem_capacity()
    machine.figure(
        f"pod limited alone: its container {'HELD' if held else 'NOT held'} ({_cuda_said(found)}); dmem.capacity "
        + ("absent" if capacity is None else f"lists {len(capacity)} nvidia line(s)")
    )
    assert (found["alloc_below"], found["create_below"]) == (CUDA_SUCCESS, CUDA_SUCCESS), found


def test_limits_are_gone_once_the_pods_sandbox_is_removed(limited_card: dict) -> None:
    """The sandbox's end as gpushare handles it: the container's and the pod's limits cleared (soft 0
    first), then the cgroups removed. Nothing is left on the removed cgroup, the reservation on the pod's
    parent is what it was, and a neighbour sees the memory it saw before."""
    uuid, env = limited_card["uuid"], machine.real_env()
    pod_limit, ctr_limit = _gpushare_limits(limited_card)
    with machine.cgroup_tree(_test_cgroup("end"), uuid) as tree:
        pod, neighbour = tree.make("pod"), tree.make("neighbour")
        ctr = tree.make("pod/ctr")
        parent_before = read_limits(tree.top, env)[uuid]
        free_before = machine.cuda(uuid, 0, neighbour)["free"]

        tree.limit(pod, pod_limit.soft_bytes, pod_limit.hard_bytes)
        tree.limit(ctr, ctr_limit.soft_bytes, ctr_limit.hard_bytes)
        ran = machine.cuda(uuid, ctr_limit.hard_bytes, ctr)  # the container's process allocates, then exits
        parent_during = read_limits(tree.top, env)[uuid]
        free_during = machine.cuda(uuid, 0, neighbour)["free"]

        tree.clear(ctr)
        tree.clear(pod)
        cleared = (read_limits(ctr, env)[uuid], read_limits(pod, env)[uuid])
        ctr.rmdir()
        pod.rmdir()  # as kubelet removes an ended pod's cgroup
        left = read_limits(pod, env)[uuid]
        parent_after = read_limits(tree.top, env)[uuid]
        free_after = machine.cuda(uuid, 0, neighbour)["free"]
    machine.figure(
        f"pod's parent: {_limits_said(parent_before)} before, {_limits_said(parent_during)} while the pod held "
        f"soft {pod_limit.soft_bytes >> 20} MiB, {_limits_said(parent_after)} after; neighbour free "
        f"{free_before >> 20} / {free_during >> 20} / {free_after >> 20} MiB; the container's process {_cuda_said(ran)}"
    )
    assert cleared == (NO_LIMIT, NO_LIMIT), f"limits left after clearing (container, pod): {cleared}"
    assert left == NO_LIMIT or isinstance(left, str), f"limits of removed cgroup {pod} remain: {left}"
    assert parent_after == parent_before, f"the pod's parent held {parent_before} before, {parent_after} after"
    assert free_after >= free_before - SLACK, f"neighbour free {free_before >> 20} MiB before, {free_after >> 20} after"
