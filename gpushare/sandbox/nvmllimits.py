"""A cgroup's GPU memory limits as the driver reports them (``nvmlDeviceGetMemoryLimits_v1`` on every
card), read in a child process that loads the node's driver library (``env``: the fake's, or None for
the real one), so that the sandbox and the tests see what the driver enforces, not what gpushare meant
to set."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

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


def describe(limits: Limits, index_of: Mapping[str, int]) -> str:
    """``card 2 8192 MiB, ...`` for the cards with a limit; ``none`` when no card has one."""
    parts = [
        f"card {index_of.get(uuid, '?')} {answer[1] >> 20} MiB"
        for uuid, answer in sorted(limits.items(), key=lambda item: index_of.get(item[0], -1))
        if isinstance(answer, tuple) and answer != NO_LIMIT
    ]
    return ", ".join(parts) or "none"
