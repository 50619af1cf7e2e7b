"""How long gpushare takes to set and take off a pod's GPU memory limits: the node agent's code path
(:class:`gpushare.memlimits.enforcer.PodLimiter` over :meth:`gpushare.gpus.nvml.NvmlBackend.set_memory_limit`,
which calls ``nvmlDeviceSetMemoryLimits_v1``), timed per pod over ``--sets`` pods, each holding half of
card 0, ``--live`` pods holding limits at a time: the pod's cgroup's limits (before its first container
is created), its container's own (made and capped before the container's process starts), and taking
both off again when the pod's sandbox ends (the oldest pod's, once more than ``--live`` hold limits);
median, p99 and max of each, in milliseconds, side by side from one run.

By default it runs on the fake libnvidia-ml (``gpushare/sandbox/fakenvml``, machine ``dgx-a100``), whose
cgroups are plain directories in a scratch folder, in a child process that finds the fake first on
``LD_LIBRARY_PATH``; the fake records every change in a file, as its limits outlive the process, so
its figures include that write (``--no-record``: without it, gpushare's part alone). ``--real`` times
the real driver instead: it needs root, cgroup v2 and a driver that enforces limits, and makes its
pods' cgroups under ``/sys/fs/cgroup/gpushare-bench-PID``, clearing each limit and removing the
cgroups afterwards.

    python benchmarks/memlimit_latency.py [--sets 2000] [--live 16] [--no-record | --real]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from gpushare.cards import Card
from gpushare.contract.units import MIB_BYTES, parse_unit
from gpushare.gpus.backend import InventoryError
from gpushare.gpus.nvml import NvmlBackend
from gpushare.memlimits.cgroups import V2, CgroupLayout, detect_layout
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.sandbox import fakenvml

MACHINE = "dgx-a100"


def measure(root: Path, layout: CgroupLayout, sets: int, live: int) -> dict[str, object]:
    """Set ``sets`` pods' limits, each on its own cgroup under ``root`` (made here), ``live`` of them
    at a time: once there are more, the oldest pod's limit is cleared and its cgroup removed, untimed."""
    unit = parse_unit("MiB")
    backend = NvmlBackend(layout=layout)
    pods: deque[Path] = deque()
    try:
        card = backend.cards()[0]
        if not card.limits_enforced:
            raise SystemExit(f"card {card.index} ({card.uuid}) doesn't enforce limits: {card.memory_limits}")
        limiter = PodLimiter(backend.set_memory_limit, layout, unit)
        held = {card.uuid: card.memory_mib // 2}
        took: dict[str, list[float]] = {"pod_ms": [], "container_ms": [], "clear_ms": []}
        for n in range(sets):
            pod = root / f"pod{n}"
            pod.mkdir()
            pods.append(pod)
            who, where = f"pod bench/p{n} container main", f"/{root.name}/{pod.name}"
            start = time.perf_counter()
            refused = limiter.apply(who, where, held, [card])
            made = time.perf_counter()
            refused = refused or limiter.apply_container(who, f"{where}/main", held, [card], make=True)
            took["pod_ms"].append(made - start)
            took["container_ms"].append(time.perf_counter() - made)
            if refused:
                raise SystemExit(refused)
            if len(pods) > live:
                took["clear_ms"].append(_remove(limiter, card, root, pods.popleft()))
        while pods:
            _remove(limiter, card, root, pods.popleft())
    finally:
        backend.close()
        for pod in pods:
            for cgroup in (pod / "main", pod):
                if cgroup.is_dir():
                    cgroup.rmdir()
    return {
        "card": f"{card.index} {card.model} ({card.uuid})",
        "limit_mib": held[card.uuid] * unit.bytes // MIB_BYTES,
        "sets": sets,
        "live_pods": live,
    } | {step: _figures(times) for step, times in took.items()}


def _figures(times: list[float]) -> dict[str, float]:
    """Median, p99 and max of ``times`` (seconds), in milliseconds."""
    took_ms = sorted(t * 1000 for t in times)
    return {
        "median": round(statistics.median(took_ms), 4),
        "p99": round(took_ms[min(len(took_ms) - 1, int(len(took_ms) * 0.99))], 4),
        "max": round(took_ms[-1], 4),
    }


def _remove(limiter: PodLimiter, card: Card, root: Path, pod: Path) -> float:
    """Take the pod's and its container's limits off as its sandbox's end does, then remove the cgroups
    as kubelet does; how long the first took."""
    start = time.perf_counter()
    failed = limiter.clear(f"pod bench/{pod.name}", f"/{root.name}/{pod.name}", [card])
    took = time.perf_counter() - start
    if failed:
        raise SystemExit("; ".join(failed))
    (pod / "main").rmdir()
    pod.rmdir()
    return took


def on_fake(sets: int, live: int, record: bool) -> dict[str, object]:
    reason = fakenvml.gcc_missing()
    if reason:
        raise SystemExit(f"the fake libnvidia-ml can't be built: {reason}")
    with tempfile.TemporaryDirectory(prefix="memlimit-bench-") as scratch:
        fake = fakenvml.prepare(MACHINE, Path(scratch))
        root = Path(scratch) / "cgroup"
        root.mkdir()
        child = [sys.executable, __file__, "--child", str(root), "--sets", str(sets), "--live", str(live)]
        env = fake.env()
        if not record:
            del env[fakenvml.ENV_LIMITS]
        done = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the measurement failed: {done.stderr.strip()[-2000:]}")
        driver = f"fake libnvidia-ml ({MACHINE}{'' if record else ', no record file'})"
        return {"driver": driver} | json.loads(done.stdout)


def on_real(sets: int, live: int) -> dict[str, object]:
    if os.geteuid() != 0:
        raise SystemExit("--real needs root: setting a cgroup's limits does, and so does making cgroups")
    layout = detect_layout(Path("/proc/self/mountinfo").read_text())
    if layout.why_not or layout.unified is None:
        raise SystemExit(f"no limits on this machine: {layout.why_not}")
    # PodLimiter reads a kubelet cgroupsPath below the hierarchy's root: the bench's cgroup sits there
    root = layout.unified / f"gpushare-bench-{os.getpid()}"
    root.mkdir()
    try:
        return {"driver": "the real NVIDIA driver"} | measure(root, layout, sets, live)
    except InventoryError as exc:
        raise SystemExit(str(exc)) from None
    finally:
        root.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", type=int, default=2000, help="pods whose limit is set (default 2000)")
    parser.add_argument("--live", type=int, default=16, help="pods with a limit at a time (default 16)")
    parser.add_argument("--real", action="store_true", help="the real driver (root, cgroup v2, driver 615+)")
    parser.add_argument("--no-record", action="store_true", help="the fake without its record file of live limits")
    parser.add_argument("--child", metavar="ROOT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # on the fake: its cgroup v2 root is a plain scratch directory
        root = Path(args.child)
        print(json.dumps(measure(root, CgroupLayout(V2, root.parent), args.sets, args.live)))
        return
    found = on_real(args.sets, args.live) if args.real else on_fake(args.sets, args.live, not args.no_record)
    print(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
