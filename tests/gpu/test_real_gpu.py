"""gpushare on a machine with a real NVIDIA GPU: its NVML inventory against what the driver reports, its
memory-limit probe against what the machine is, and, where the driver enforces per-cgroup limits, a
CUDA process in a limited cgroup held to its cap. Every check skips, with one line, where no NVIDIA
driver is loaded; run them as CONTRIBUTING.md ("Testing on a real GPU") says.

What the driver reports is read without gpushare (nvidia-smi, /proc/driver/nvidia, sysfs), and every
NVML or CUDA call runs in a child process given the real libnvidia-ml.so.1, never the fake one
(``machine.real_env``). NVIDIA's NVML reference (nvmlSetMemoryLimits_v1_t,
https://docs.nvidia.com/deploy/nvml-api/api/structnvmlSetMemoryLimits__v1__t.html): the soft limit is
what is guaranteed before allocations may fail under memory pressure, the hard limit the most that can
be allocated; soft 0 and hard NVML_DEVICE_MEMORY_LIMIT_MAX clear the limits, and so does removing the
cgroup."""

from __future__ import annotations

import os
import warnings

import pytest

from gpu import machine
from gpu.cudadriver import CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, MIB
from gpushare.cards import ENFORCED
from gpushare.sandbox.nvmllimits import NO_LIMIT, clear_limits, read_limits

# a mark rather than a module-level skip: pytest exits 0 with every test skipped, 5 with none collected
_WHY_NOT = machine.no_driver()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")

GIB = 1 << 30
#: how far the memory a process sees may move while the checks run (the driver's own bookkeeping)
SLACK = 64 * MIB


@pytest.fixture(scope="module")
def driver_cards() -> list[machine.SmiCard]:
    """The cards nvidia-smi lists, less those in MIG mode (which gpushare leaves out)."""
    return [card for card in machine.smi_cards() if not card.mig]


@pytest.fixture(scope="module")
def cards() -> list[dict]:
    """gpushare's inventory (``--gpus nvml``), each card as a dict of :class:`gpushare.cards.Card`."""
    return machine.inventory()


def test_inventory_is_what_the_driver_reports(driver_cards: list[machine.SmiCard], cards: list[dict]) -> None:
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


def test_nvlink_peers_are_what_the_driver_reports(driver_cards: list[machine.SmiCard], cards: list[dict]) -> None:
    uuid_at = {c.index: c.uuid for c in driver_cards}
    expected = {uuid: set() for uuid in uuid_at.values()}
    for pair in machine.nvlink_pairs(len(machine.smi_cards())):
        a, b = sorted(pair)
        if a in uuid_at and b in uuid_at:
            expected[uuid_at[a]].add(uuid_at[b])
            expected[uuid_at[b]].add(uuid_at[a])
    assert {c["uuid"]: set(c["nvlink_peers"]) for c in cards} == expected


def _expected_probe() -> tuple[str, ...]:
    """What the node agent's probe may say here, from the machine alone: ``enforced``, or how the
    reason it gives starts."""
    if machine.cgroup_fs() != "cgroup2fs":
        return ("cgroup ",)  # cgroup v1 (...) or cgroup hybrid (...)
    if machine.driver_release() < machine.LIMITS_RELEASE:  # the driver lacks the call
        return ("the driver has no per-cgroup memory limits",)
    refused = "nvmlDeviceGetMemoryLimits_v1 failed: "  # NVML's answer, e.g. Insufficient Permissions
    if machine.sandboxed():
        return (refused,)
    return (ENFORCED,) if os.geteuid() == 0 else (ENFORCED, refused)


def test_memory_limit_probe_says_what_the_machine_is(cards: list[dict]) -> None:
    expected = _expected_probe()
    for card in cards:
        said = card["memory_limits"]
        ok = any(said == e if e == ENFORCED else said.startswith(e) for e in expected)
        assert ok, f"card {card['index']}: the probe says {said!r}, expected {' or '.join(expected)}"


def test_cuda_allocates_the_whole_card_without_a_limit(driver_cards: list[machine.SmiCard]) -> None:
    for card in driver_cards:
        found = machine.cuda(card.uuid, 0)
        usable = card.memory_mib - card.reserved_mib  # what the driver keeps for itself is not CUDA's
        assert usable * 0.99 <= found["total"] / MIB <= card.memory_mib, (card.uuid, found)
        assert found["alloc_below"] == CUDA_SUCCESS, (card.uuid, found)
        assert found["create_below"] == CUDA_SUCCESS, (card.uuid, found)


def test_a_cgroup_limited_to_1_gib_is_held_to_it(cards: list[dict]) -> None:
    card = cards[0]
    if card["memory_limits"] != ENFORCED:
        pytest.skip(f"memory limits not enforced on card {card['index']}: {card['memory_limits']}")
    if os.geteuid() != 0:
        pytest.skip("not root: the test makes cgroups and sets limits (nvmlDeviceSetMemoryLimits_v1 needs root)")
    uuid, env = card["uuid"], machine.real_env()
    with machine.owned_cgroup(f"gpushare-gpu-test-{os.getpid()}") as top:
        # top/pod is limited, as gpushare limits a pod's cgroup; top/pod/ctr holds the process, as a
        # container's cgroup does; top/probe is a neighbour outside the limit.
        pod, probe = top / "pod", top / "probe"
        ctr = pod / "ctr"
        for directory in (pod, ctr, probe):
            directory.mkdir()
        before = machine.cuda(uuid, 0, probe)["free"]

        machine.gpushare("set", uuid, str(pod), str(GIB), str(GIB))
        assert read_limits(pod, env)[uuid] == (GIB, GIB)
        found = machine.cuda(uuid, GIB, ctr)
        # what the process may still allocate is within the cap (NVML's reference: memory info, read
        # in the cgroup, says what is actually available there)
        assert found["free"] <= GIB, f"cuMemGetInfo shows no cap: {found}"
        assert (found["alloc_below"], found["create_below"]) == (CUDA_SUCCESS, CUDA_SUCCESS), found
        assert (found["alloc_past"], found["create_past"]) == (CUDA_ERROR_OUT_OF_MEMORY,) * 2, found

        clear_limits(pod, env)
        assert read_limits(pod, env)[uuid] == NO_LIMIT
        assert machine.cuda(uuid, 0, ctr)["total"] > GIB  # the card again

        machine.gpushare("set", uuid, str(pod), str(GIB), str(GIB))
        ctr.rmdir()
        pod.rmdir()  # as kubelet removes an ended pod's cgroup: the driver drops its limits
        left = read_limits(pod, env)[uuid]
        assert left == NO_LIMIT or isinstance(left, str), f"limits of removed cgroup {pod} remain: {left}"
        after = machine.cuda(uuid, 0, probe)["free"]
        assert after >= before - SLACK, f"free memory {before >> 20} MiB before the limit, {after >> 20} MiB after"
