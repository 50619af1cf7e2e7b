"""Per-container GPU memory limits on the fake libnvidia-ml (NVML's nvmlDeviceSetMemoryLimits_v1 and
nvmlDeviceGetMemoryLimits_v1, driver 615+), driven through the real pynvml binding in a child process as a
node agent would drive the driver: what is set reads back and is recorded, bad requests get NVML's codes,
a removed cgroup loses its limit, and a driver older than 615 has no such calls. On real cgroups it models
what NVIDIA documents (https://docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html): a process
in a limited cgroup is told the hard cap (under dmem its ancestors' too, under misc its own only), a soft
limit is reserved on every ancestor and drifts there when its cgroup goes before it is cleared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from support.nvml import described_cards, fake_machine

from gpushare.memlimits.cgroups import cgroup_mounts
from gpushare.sandbox import fakenvml
from gpushare.sandbox.launch import ClusterError
from gpushare.sandbox.nvmllimits import memory_info

MAX = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX: no hard limit
GIB = 1 << 30
MIB = 1 << 20

#: the operations a child runs, each answered with (JSON) an NVML error's class name, [soft, hard,
#: currentUsed] for a get, [total, free, used, reserved (None from v1)] for memory, the record file's text,
#: else "ok"
OPERATIONS = r"""
import json, os, sys
import pynvml as nvml

def run(op, *args):
    if op == "rmdir":
        os.rmdir(args[0])
    elif op == "mkdir":
        os.mkdir(args[0])
    elif op == "lose":
        with open(os.environ["GPUSHARE_FAKE_NVML_CONTROL"], "a") as control:
            control.write(f"lose {args[0]}\n")
    elif op == "record":
        with open(os.environ["GPUSHARE_FAKE_NVML_LIMITS"]) as record:
            return record.read()
    elif op == "cards":
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        return [nvml.nvmlSystemGetDriverVersion(), *(nvml.nvmlDeviceGetUUID(h) for h in handles)]
    elif op == "memory":
        memory = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(args[0].encode()), version=args[1])
        return [memory.total, memory.free, memory.used, getattr(memory, "reserved", None)]
    else:
        handle = nvml.nvmlDeviceGetHandleByUUID(args[0].encode())
        path = None if args[1] is None else args[1].encode()
        if op == "set":
            nvml.nvmlDeviceSetMemoryLimits_v1(handle, nvml.c_nvmlSetMemoryLimits_v1_t(path, args[2], args[3]))
        else:
            limits = nvml.c_nvmlGetMemoryLimits_v1_t(path)
            nvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
            return [limits.softLimit, limits.hardLimit, limits.currentUsed]
    return "ok"

def answer(op):
    try:
        return run(*op)
    except nvml.NVMLError as error:
        return type(error).__name__
"""
#: runs the operations in argv[1] (JSON) between nvmlInit and nvmlShutdown and prints their answers (JSON)
CHILD = (
    OPERATIONS
    + r"""
nvml.nvmlInit()
print(json.dumps([answer(op) for op in json.loads(sys.argv[1])]))
nvml.nvmlShutdown()
"""
)
#: a process that stays initialised, as a node agent does: one operation a line on stdin, one answer a line
SESSION = (
    OPERATIONS
    + r"""
nvml.nvmlInit()
for line in sys.stdin:
    print(json.dumps(answer(json.loads(line))), flush=True)
"""
)

#: the two calls' answers, through ctypes, before nvmlInit and then with a NULL device and a NULL struct
CHILD_RAW = r"""
import ctypes, json
lib = ctypes.CDLL("libnvidia-ml.so.1")
calls = (lib.nvmlDeviceSetMemoryLimits_v1, lib.nvmlDeviceGetMemoryLimits_v1)
before = [call(None, None) for call in calls]
assert lib.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
print(json.dumps([before, [call(None, None) for call in calls], [call(handle, None) for call in calls]]))
"""


def run_child(env: dict[str, str], code: str, *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def nvml_calls(fake: fakenvml.FakeNvml, *ops: list[Any]) -> list[Any]:
    """The answers to ``ops`` (see CHILD) in a fresh process on ``fake``'s machine."""
    return run_child(fake.env(), CHILD, json.dumps(ops))


def uuids(machine: str) -> list[str]:
    return [card["uuid"] for card in described_cards(machine)]


@pytest.fixture
def mixed(tmp_path: Path) -> fakenvml.FakeNvml:
    return fake_machine("mixed", tmp_path)


def cgroups(tmp_path: Path, *names: str) -> list[str]:
    """Directories standing in for containers' cgroups."""
    for name in names:
        (tmp_path / name).mkdir()
    return [str(tmp_path / name) for name in names]


def test_a_limit_set_reads_back_and_is_recorded(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    a0, a1, *_ = uuids("mixed")
    first, second, unlimited = cgroups(tmp_path, "first", "second", "unlimited")
    answers = nvml_calls(
        mixed,
        ["set", a0, first, 2 * GIB, 4 * GIB],
        ["set", a1, second, 0, 40 * GIB],  # the whole card: a hard limit may equal its memory
        ["set", a0, first, 1 * GIB, 3 * GIB],  # changed, not added
        ["get", a0, first],
        ["get", a1, second],
        ["get", a0, unlimited],
        ["get", a1, first],  # limits are per card
    )
    assert answers == [
        "ok",
        "ok",
        "ok",
        [1 * GIB, 3 * GIB, 0],
        [0, 40 * GIB, 0],
        [0, MAX, 0],
        [0, MAX, 0],
    ]
    assert mixed.limits() == {(a0, first): (1 * GIB, 3 * GIB), (a1, second): (0, 40 * GIB)}
    assert mixed.limits_record.read_text().splitlines() == [
        f"{a0} {1 * GIB} {3 * GIB} 0 {first}",  # in the order first set; plain directories hold nothing
        f"{a1} 0 {40 * GIB} 0 {second}",
    ]


def test_limits_outlive_the_process_that_set_them(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    a0 = uuids("mixed")[0]
    [cgroup] = cgroups(tmp_path, "cgroup")
    assert nvml_calls(mixed, ["set", a0, cgroup, GIB, 2 * GIB]) == ["ok"]
    assert nvml_calls(mixed, ["get", a0, cgroup]) == [[GIB, 2 * GIB, 0]]


class Session:
    """A child process on ``fake``'s machine that stays initialised between operations."""

    def __init__(self, fake: fakenvml.FakeNvml) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SESSION], env=fake.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def call(self, *op: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(op) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def test_processes_share_one_set_of_limits_as_with_the_driver(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    """A long-running process (the node agent) sees what another one changed, and its own next change
    (here dropping the limit of a removed cgroup) doesn't write back a limit the other one cleared."""
    a0, a1, *_ = uuids("mixed")
    cleared, changed, removed = cgroups(tmp_path, "cleared", "changed", "removed")
    agent = Session(mixed)
    try:
        for cgroup in (cleared, changed, removed):
            assert agent.call("set", a0, cgroup, 4 * GIB, 4 * GIB) == "ok"
        assert nvml_calls(mixed, ["set", a0, cleared, 0, MAX], ["set", a0, changed, GIB, 2 * GIB]) == ["ok", "ok"]
        assert agent.call("get", a0, changed) == [GIB, 2 * GIB, 0]
        (tmp_path / "removed").rmdir()
        assert agent.call("get", a1, changed) == [0, MAX, 0]  # any call drops the removed cgroup's limit
    finally:
        agent.close()
    assert nvml_calls(mixed, ["get", a0, cleared]) == [[0, MAX, 0]]
    assert mixed.limits() == {(a0, changed): (GIB, 2 * GIB)}


def test_soft_zero_and_hard_max_clears_the_limit(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    a0 = uuids("mixed")[0]
    kept, cleared = cgroups(tmp_path, "kept", "cleared")
    answers = nvml_calls(
        mixed,
        ["set", a0, kept, GIB, GIB],
        ["set", a0, cleared, GIB, 2 * GIB],
        ["set", a0, cleared, 0, MAX],
        ["get", a0, cleared],
        ["set", a0, cleared, 0, MAX],  # clearing what is not set is no error
    )
    assert answers == ["ok", "ok", "ok", [0, MAX, 0], "ok"]
    assert mixed.limits() == {(a0, kept): (GIB, GIB)}


def test_bad_limits_are_invalid_arguments_and_change_nothing(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    a0, _, t4, _ = uuids("mixed")
    [cgroup] = cgroups(tmp_path, "cgroup")
    answers = nvml_calls(
        mixed,
        ["set", a0, cgroup, GIB, 2 * GIB],
        ["set", a0, cgroup, 3 * GIB, 2 * GIB],  # soft above hard
        ["set", t4, cgroup, 0, 15 * GIB + 1],  # hard above the T4's 15 GiB
        ["set", a0, None, 0, GIB],  # no cgroup named
        ["get", a0, None],
        ["get", a0, cgroup],
    )
    invalid = "NVMLError_InvalidArgument"
    assert answers == ["ok", invalid, invalid, invalid, invalid, [GIB, 2 * GIB, 0]]
    assert mixed.limits() == {(a0, cgroup): (GIB, 2 * GIB)}


def test_null_device_or_struct_and_calls_before_init(mixed: fakenvml.FakeNvml) -> None:
    uninitialized, invalid = 1, 2
    assert run_child(mixed.env(), CHILD_RAW) == [[uninitialized] * 2, [invalid] * 2, [invalid] * 2]


def test_a_path_that_is_not_a_directory_is_not_found(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    a0 = uuids("mixed")[0]
    (tmp_path / "file").write_text("")
    missing, file = str(tmp_path / "missing"), str(tmp_path / "file")
    answers = nvml_calls(mixed, ["set", a0, missing, 0, GIB], ["get", a0, missing], ["set", a0, file, 0, GIB])
    assert answers == ["NVMLError_NotFound"] * 3
    assert mixed.limits() == {}


def test_removing_the_cgroup_drops_its_limit(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    a0, a1, *_ = uuids("mixed")
    removed, kept = cgroups(tmp_path, "removed", "kept")
    answers = nvml_calls(
        mixed,
        ["set", a0, removed, GIB, 2 * GIB],
        ["set", a1, removed, GIB, 2 * GIB],
        ["set", a0, kept, GIB, 2 * GIB],
        ["rmdir", removed],
        ["cards"],  # any call drops it, and the record follows
        ["record"],
        ["get", a0, removed],
        ["mkdir", removed],
        ["get", a0, removed],
        ["get", a1, removed],
    )
    assert answers[4] == ["550.54.15", *uuids("mixed")]  # the default driver version
    assert answers[5] == f"{a0} {GIB} {2 * GIB} 0 {kept}\n"
    assert answers[6:] == ["NVMLError_NotFound", "ok", [0, MAX, 0], [0, MAX, 0]]
    assert mixed.limits() == {(a0, kept): (GIB, 2 * GIB)}


def test_a_soft_limit_gone_with_its_cgroup_is_recorded_as_leaked_and_a_cleared_one_is_not(
    mixed: fakenvml.FakeNvml, tmp_path: Path
) -> None:
    a0, a1, *_ = uuids("mixed")
    leaked, cleared, hard_only = cgroups(tmp_path, "leaked", "cleared", "hard-only")
    nvml_calls(
        mixed,
        ["set", a0, leaked, GIB, 2 * GIB],
        ["set", a1, cleared, GIB, 2 * GIB],
        ["set", a1, hard_only, 0, 2 * GIB],
        ["set", a1, cleared, 0, MAX],
        ["rmdir", leaked],
        ["rmdir", cleared],
        ["rmdir", hard_only],
        ["cards"],
    )
    assert mixed.limits() == {}
    assert mixed.leaks() == [(a0, GIB, leaked)]


def test_a_card_in_mig_mode_does_not_support_limits(tmp_path: Path) -> None:
    whole, mig = uuids("mig")
    fake = fake_machine("mig", tmp_path)
    [cgroup] = cgroups(tmp_path, "cgroup")
    answers = nvml_calls(fake, ["set", mig, cgroup, 0, GIB], ["get", mig, cgroup], ["set", whole, cgroup, 0, GIB])
    assert answers == ["NVMLError_NotSupported", "NVMLError_NotSupported", "ok"]
    assert fake.limits() == {(whole, cgroup): (0, GIB)}


def test_a_lost_card_answers_gpu_is_lost(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    a0 = uuids("mixed")[0]
    [cgroup] = cgroups(tmp_path, "cgroup")
    answers = nvml_calls(mixed, ["set", a0, cgroup, 0, GIB], ["lose", a0], ["set", a0, cgroup, 0, MAX])
    assert answers == ["ok", "ok", "NVMLError_GpuIsLost"]
    assert mixed.limits() == {(a0, cgroup): (0, GIB)}


def test_the_description_can_make_either_call_fail(tmp_path: Path) -> None:
    card = described_cards("mixed")[0]
    machine = tmp_path / "failing.txt"
    lines = [f"{key} {value}" for key, value in card.items()]
    lines += ["fail nvmlDeviceSetMemoryLimits_v1 not-supported", "fail nvmlDeviceGetMemoryLimits_v1 unknown"]
    machine.write_text("driver loaded\ngpu\n" + "\n".join(lines) + "\n")
    fake = fake_machine(str(machine), tmp_path)
    [cgroup] = cgroups(tmp_path, "cgroup")
    answers = nvml_calls(fake, ["set", card["uuid"], cgroup, 0, GIB], ["get", card["uuid"], cgroup])
    assert answers == ["NVMLError_NotSupported", "NVMLError_Unknown"]


def test_an_old_driver_has_no_memory_limit_calls(tmp_path: Path) -> None:
    first, second = uuids("old-driver")
    fake = fake_machine("old-driver", tmp_path)
    [cgroup] = cgroups(tmp_path, "cgroup")
    answers = nvml_calls(fake, ["cards"], ["set", first, cgroup, 0, GIB], ["get", second, cgroup])
    assert answers == [["580.95.05", first, second], "NVMLError_FunctionNotFound", "NVMLError_FunctionNotFound"]


def test_an_old_driver_built_in_has_no_memory_limit_calls(tmp_path: Path) -> None:
    """As in a pod that mounts only the library of an old-driver host."""
    if reason := fakenvml.gcc_missing():
        pytest.skip(f"the fake libnvidia-ml can't be built: {reason}")
    library = fakenvml.build_with_machine("old-driver")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_FAKE_NVML_")}
    env["LD_LIBRARY_PATH"] = str(library.parent)
    [cgroup] = cgroups(tmp_path, "cgroup")
    first = uuids("old-driver")[0]
    answers = run_child(env, CHILD, json.dumps([["cards"], ["get", first, cgroup]]))
    assert answers == [["580.95.05", *uuids("old-driver")], "NVMLError_FunctionNotFound"]


def test_a_library_with_the_calls_refuses_an_old_driver_machine(mixed: fakenvml.FakeNvml) -> None:
    """A description and a library that disagree about the calls fail at nvmlInit, saying why."""
    env = mixed.env()
    env[fakenvml.ENV_MACHINE] = str(fakenvml.machine_file("old-driver"))
    done = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "the machine says memory-limits absent but this library exports them" in done.stderr
    assert "NVMLError_Unknown" in done.stderr


def test_a_description_with_a_bad_backend_or_reservation_is_refused(tmp_path: Path) -> None:
    card = {key: value for key, value in described_cards("mixed")[0].items() if key != "reserved-mib"}
    for bad in ("memory-limits-backend cgroup-v1", f"reserved-mib {int(card['memory-mib']) + 1}"):
        machine = tmp_path / "bad.txt"
        machine.write_text("driver loaded\ngpu\n" + "".join(f"{k} {v}\n" for k, v in card.items()) + bad + "\n")
        done = subprocess.run(
            [sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"],
            env=fake_machine(str(machine), tmp_path).env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode != 0 and f"line {len(card) + 3} is not understood" in done.stderr, bad


# --- memory info, and limits on real cgroups ------------------------------------------------------------


def whole_card(card: dict[str, str]) -> tuple[int, int]:
    """(total, free) that NVML reports of a described card outside any limit: the card less what the
    driver reserves."""
    return int(card["memory-mib"]) * MIB, (int(card["memory-mib"]) - int(card.get("reserved-mib", 0))) * MIB


def test_outside_a_limit_memory_info_is_the_card_less_what_the_driver_reserves(tmp_path: Path) -> None:
    """v2 says what is reserved; v1 has no field for it and counts it as used. A card described without a
    reservation reserves nothing."""
    dgx = fake_machine("dgx-a100", tmp_path)
    card = described_cards("dgx-a100")[0]
    total, free = whole_card(card)
    reserved = int(card["reserved-mib"]) * MIB
    assert reserved > 0
    v1, v2, wrong_version = nvml_calls(
        dgx,
        ["memory", card["uuid"], None],
        ["memory", card["uuid"], pynvml.nvmlMemory_v2],
        ["memory", card["uuid"], pynvml.nvmlMemory_v2 ^ (3 << 24)],  # version 1 of a struct that has none
    )
    assert v1 == [total, free, reserved, None]
    assert v2 == [total, free, 0, reserved]
    assert wrong_version == "NVMLError_ArgumentVersionMismatch"

    plain = {key: value for key, value in described_cards("mixed")[0].items() if key != "reserved-mib"}
    machine = tmp_path / "unreserved.txt"
    machine.write_text("driver loaded\ngpu\n" + "".join(f"{k} {v}\n" for k, v in plain.items()))
    memory = int(plain["memory-mib"]) * MIB
    assert nvml_calls(fake_machine(str(machine), tmp_path), ["memory", plain["uuid"], pynvml.nvmlMemory_v2]) == [
        [memory, memory, 0, 0]
    ]


def test_plain_directories_hold_nothing_for_their_subdirectories(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    """A scratch folder's directories are no cgroups: a soft limit reserves nothing above them."""
    a0 = uuids("mixed")[0]
    parent, child = cgroups(tmp_path, "parent", "parent/child")
    assert nvml_calls(mixed, ["set", a0, child, GIB, 2 * GIB], ["get", a0, parent]) == ["ok", [0, MAX, 0]]
    assert mixed.held() == {}


def test_memory_info_needs_a_cgroup_to_move_its_process_into(mixed: fakenvml.FakeNvml, tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="can't move a process into"):
        memory_info(tmp_path, mixed.env())


@pytest.fixture
def cgroup_scratch() -> Iterator[Path]:
    """A cgroup of its own under the cgroup2 mount; it and every cgroup made under it are removed after."""
    if os.geteuid() != 0:
        pytest.skip("making cgroups and moving processes into them takes root")
    cgroup2 = [
        where for fstype, where in cgroup_mounts(Path("/proc/self/mountinfo").read_text()) if fstype == "cgroup2"
    ]
    if not cgroup2:
        pytest.skip("no cgroup2 mount in /proc/self/mountinfo")
    try:
        scratch = Path(tempfile.mkdtemp(prefix="gpushare-test-", dir=cgroup2[0]))
    except OSError as error:
        pytest.skip(f"can't make a cgroup under {cgroup2[0]}: {error}")
    try:
        yield scratch
    finally:
        for directory, _, _ in os.walk(scratch, topdown=False):  # children first
            os.rmdir(directory)


def misc_dgx(tmp_path: Path) -> fakenvml.FakeNvml:
    """The dgx-a100 machine with its limits enforced by the driver's own misc backend."""
    machine = tmp_path / "dgx-misc.txt"
    machine.write_text("memory-limits-backend misc\n" + fakenvml.machine_file("dgx-a100").read_text())
    return fake_machine(str(machine), tmp_path)


@pytest.mark.parametrize("backend", ["dmem", "misc"])
def test_a_process_is_told_the_hard_cap_on_its_cgroup(backend: str, cgroup_scratch: Path, tmp_path: Path) -> None:
    """Under dmem a container's process is held by the smallest hard limit of its cgroup and the pod's; under
    misc by its own cgroup's only. Cards without a limit report the card less what the driver reserves."""
    fake = fake_machine("dgx-a100", tmp_path) if backend == "dmem" else misc_dgx(tmp_path)
    cards = described_cards("dgx-a100")
    a0, a1, a2, a3 = (card["uuid"] for card in cards[:4])
    pod, container = cgroups(cgroup_scratch, "pod", "pod/container")
    assert (
        nvml_calls(
            fake,
            ["set", a0, pod, 0, 8 * GIB],
            ["set", a0, container, 0, 20 * GIB],  # more than the pod may have
            ["set", a1, container, 0, 4 * GIB],
            ["set", a2, pod, 0, 6 * GIB],  # the pod only
        )
        == ["ok"] * 4
    )
    seen = memory_info(Path(container), fake.env())
    pod_capped = {"dmem": (6 * GIB, 6 * GIB), "misc": whole_card(cards[2])}[backend]
    assert [seen[uuid] for uuid in (a0, a1, a2, a3)] == [
        {"dmem": (8 * GIB, 8 * GIB), "misc": (20 * GIB, 20 * GIB)}[backend],
        (4 * GIB, 4 * GIB),
        pod_capped,
        whole_card(cards[3]),
    ]
    assert seen.keys() == {card["uuid"] for card in cards}
    in_pod = memory_info(Path(pod), fake.env())
    assert [in_pod[uuid] for uuid in (a0, a1, a2)] == [(8 * GIB, 8 * GIB), whole_card(cards[1]), (6 * GIB, 6 * GIB)]
    # a limit is matched by the cgroup, however its path is spelled
    assert nvml_calls(fake, ["set", a1, f"{pod}//container/../container/", 0, MAX]) == ["ok"]
    assert memory_info(Path(container), fake.env())[a1] == whole_card(cards[1])


def test_a_soft_limit_is_reserved_on_every_ancestor_until_it_is_cleared(
    cgroup_scratch: Path, mixed: fakenvml.FakeNvml
) -> None:
    a0, a1, *_ = uuids("mixed")
    scratch = str(cgroup_scratch)
    pod, container = cgroups(cgroup_scratch, "pod", "pod/container")
    answers = nvml_calls(
        mixed,
        ["set", a0, pod, GIB, 8 * GIB],
        ["set", a0, container, 2 * GIB, 4 * GIB],
        ["get", a0, container],
        ["get", a0, pod],  # its own soft limit and what it holds for the container
        ["get", a0, scratch],
        ["get", a1, pod],  # per card
    )
    assert answers == ["ok", "ok", [2 * GIB, 4 * GIB, 0], [3 * GIB, 8 * GIB, 0], [3 * GIB, MAX, 0], [0, MAX, 0]]
    assert mixed.held() == {(a0, pod): 2 * GIB, (a0, scratch): 3 * GIB}
    assert mixed.limits() == {(a0, pod): (GIB, 8 * GIB), (a0, container): (2 * GIB, 4 * GIB)}

    answers = nvml_calls(
        mixed,
        ["set", a0, container, 3 * GIB, 4 * GIB],  # the change is added, not the whole
        ["get", a0, pod],
        ["set", a0, container, 0, MAX],
        ["get", a0, pod],
        ["get", a0, scratch],
        ["set", a0, pod, 0, MAX],
        ["get", a0, scratch],
    )
    assert answers == ["ok", [4 * GIB, 8 * GIB, 0], "ok", [GIB, 8 * GIB, 0], [GIB, MAX, 0], "ok", [0, MAX, 0]]
    assert mixed.held() == {} and mixed.limits() == {} and mixed.leaks() == []


def test_a_cgroup_removed_with_its_soft_limit_set_leaves_it_on_its_ancestors(
    cgroup_scratch: Path, mixed: fakenvml.FakeNvml
) -> None:
    """The drift NVIDIA warns of: the reservation is never given back, and a new cgroup of the same name
    that sets it again reserves it twice."""
    a0 = uuids("mixed")[0]
    scratch = str(cgroup_scratch)
    pod, container = cgroups(cgroup_scratch, "pod", "pod/container")
    answers = nvml_calls(
        mixed,
        ["set", a0, container, 2 * GIB, 4 * GIB],
        ["rmdir", container],
        ["get", a0, pod],
        ["mkdir", container],
        ["get", a0, container],
        ["set", a0, container, 2 * GIB, 4 * GIB],
        ["set", a0, container, 0, MAX],  # gives back only what this one set
        ["get", a0, pod],
    )
    assert answers == ["ok", "ok", [2 * GIB, MAX, 0], "ok", [0, MAX, 0], "ok", "ok", [2 * GIB, MAX, 0]]
    assert mixed.leaks() == [(a0, 2 * GIB, container)]
    assert mixed.held() == {(a0, pod): 2 * GIB, (a0, scratch): 2 * GIB}
    assert mixed.limits() == {}
