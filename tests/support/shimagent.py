"""A stand-in node agent for the detached CRI shim's tests: starts (or adopts) the shim as ``gpushare node``
does in that mode, prints what it found as one JSON line, and waits for SIGTERM, as an agent serves.

Usage: shimagent.py SOCKET RUNTIME ESCAPE_BELOW_PID BLOCK_UNREQUESTED(0|1)
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

from gpushare.crishim.handover import start_detached_shim

from gpushare.contract.units import GIB
from gpushare.settings import NodeSettings, RewriteOptions, ShimSettings

#: where this machine's cgroup hierarchies are mounted
CGROUP_ROOT = Path("/sys/fs/cgroup")


def main(socket: str, runtime: str, below: str, block: str) -> None:
    node = NodeSettings("node-a", None, "sim:2xA100-80GB:81920", Path("/nonexistent"), GIB, frozenset())
    shim = ShimSettings(f"unix://{socket}", runtime, False, RewriteOptions(block_unrequested_gpu=block == "1"))
    stopping = threading.Event()  # listening before it says it serves, so no SIGTERM finds it deaf
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    handle = start_detached_shim(node, shim, CGROUP_ROOT, drain_seconds=10.0, escape_below=int(below))
    pid = handle.record.supervisor
    print(json.dumps({"adopted": handle.adopted, "pid": pid.pid, "start_time": pid.start_time}), flush=True)
    stopping.wait()
    handle.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
