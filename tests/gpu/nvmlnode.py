"""gpushare's NVML backend on this machine's driver, run as a child process so that the checks in this
folder load the real ``libnvidia-ml.so.1`` (see ``machine.real_env``):

    nvmlnode.py inventory                          the cards, as JSON, with each one's memory-limit probe
    nvmlnode.py set UUID CGROUP SOFT HARD          set a cgroup's limits (bytes) on one card
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from gpushare.gpus.nvml import NvmlBackend
from gpushare.memlimits.cgroups import detect_layout


def main(argv: list[str]) -> None:
    # as the node agent run without --cgroup-root reads it (NodeSettings.cgroup_layout)
    backend = NvmlBackend(layout=detect_layout(Path("/proc/self/mountinfo").read_text()))
    try:
        if argv[0] == "inventory":
            print(json.dumps([dataclasses.asdict(card) for card in backend.cards()]))
        elif argv[0] == "set":
            uuid, cgroup, soft, hard = argv[1:]
            backend.set_memory_limit(uuid, Path(cgroup), int(soft), int(hard))
        else:
            raise SystemExit(f"unknown command {argv[0]!r}")
    finally:
        backend.close()


if __name__ == "__main__":
    main(sys.argv[1:])
