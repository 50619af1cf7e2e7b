"""A cgroup's GPU memory limits as the driver reports them (``nvmlDeviceGetMemoryLimits_v1`` on every
card), and the memory a process inside it is told it has (``nvmlDeviceGetMemoryInfo_v2``), read in a child
process that loads the node's driver library (``env``: the fake's, or None for the real one), so that the
sandbox and the tests see what the driver enforces, not what gpushare meant to set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from gpushare.memlimits.cgroups import cgroup_mounts
from gpushare.sandbox.launch import ClusterError

#: what NVML answers for a cgroup with no limit on a card: (soft, hard)
NO_LIMIT = (0, 0xFFFFFFFFFFFFFFFF)

_CARDS = """
import json, sys, pynvml
pynvml.nvmlInit()
def each_card():
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        yield (uuid.decode() if isinstance(uuid, bytes) else uuid), handle
"""
_READ = (
    _CARDS
    + """
found = {}
for uuid, handle in each_card():
    limits = pynvml.c_nvmlGetMemoryLimits_v1_t()
    limits.nameSpace = sys.argv[1].encode()
    try:
        pynvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
        found[uuid] = [limits.softLimit, limits.hardLimit]
    except pynvml.NVMLError as exc:
        found[uuid] = str(exc)
print(json.dumps(found))
"""
)
_CLEAR = (
    _CARDS
    + """
for uuid, handle in each_card():
    limits = pynvml.c_nvmlSetMemoryLimits_v1_t()
    limits.nameSpace, limits.softLimit, limits.hardLimit = sys.argv[1].encode(), 0, 0xFFFFFFFFFFFFFFFF
    pynvml.nvmlDeviceSetMemoryLimits_v1(handle, limits)
"""
)

#: joins the cgroup in argv[1] before anything loads the driver library, as a container's process starts
#: in its cgroup, then prints each card's [total, free] from nvmlDeviceGetMemoryInfo_v2
_MEMORY = (
    """
import os, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as procs:
    procs.write(str(os.getpid()))
"""
    + _CARDS
    + """
found = {}
for uuid, handle in each_card():
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    found[uuid] = [memory.total, memory.free]
print(json.dumps(found))
"""
)

Limits = dict[str, tuple[int, int] | str]


def _run(script: str, cgroup: Path, env: Mapping[str, str] | None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script, str(cgroup)], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise ClusterError(f"NVML on cgroup {cgroup}: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def read_limits(cgroup: Path, env: Mapping[str, str] | None) -> Limits:
    """Per card UUID, the (soft, hard) limits in bytes of ``cgroup``, or NVML's error for that card."""
    raw = json.loads(_run(_READ, cgroup, env))
    return {uuid: tuple(answer) if isinstance(answer, list) else answer for uuid, answer in raw.items()}


def clear_limits(cgroup: Path, env: Mapping[str, str] | None) -> None:
    """Take ``cgroup``'s limits off every card, as if the driver had lost them."""
    _run(_CLEAR, cgroup, env)


def memory_info(cgroup: Path, env: Mapping[str, str] | None) -> dict[str, tuple[int, int]]:
    """Per card UUID, the (total, free) bytes that ``nvmlDeviceGetMemoryInfo_v2`` reports to a process in
    ``cgroup``: under a hard limit, NVIDIA documents, that is the cap
    (https://docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html). The child process is moved
    into ``cgroup`` before it loads the library, which takes root and a directory of a cgroup2 mount."""
    cgroup = Path(os.path.abspath(cgroup))
    cgroup2 = [
        where for fstype, where in cgroup_mounts(Path("/proc/self/mountinfo").read_text()) if fstype == "cgroup2"
    ]
    if os.geteuid() != 0:
        raise ClusterError(f"can't move a process into cgroup {cgroup}: that takes root")
    if not (cgroup / "cgroup.procs").is_file() or not any(cgroup.is_relative_to(where) for where in cgroup2):
        raise ClusterError(f"can't move a process into {cgroup}: it is no directory of a cgroup2 mount")
    raw = json.loads(_run(_MEMORY, cgroup, env))
    return {uuid: (total, free) for uuid, (total, free) in raw.items()}


def describe(limits: Limits, index_of: Mapping[str, int]) -> str:
    """``card 2 8192 MiB, ...`` for the cards with a limit; ``none`` when no card has one."""
    parts = [
        f"card {index_of.get(uuid, '?')} {answer[1] >> 20} MiB"
        for uuid, answer in sorted(limits.items(), key=lambda item: index_of.get(item[0], -1))
        if isinstance(answer, tuple) and answer != NO_LIMIT
    ]
    return ", ".join(parts) or "none"
