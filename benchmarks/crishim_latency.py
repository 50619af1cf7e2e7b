"""What the CRI shim adds to a call: the same calls straight to containerd and through the shim, in one run.

Starts a private containerd with ``--containers`` containers, and the shim as its own process (as on a
node), then measures:
- p50 and p99 latency of Version and of ListContainers, one call at a time;
- throughput at ``--concurrency`` concurrent callers (separate processes, so the client's GIL isn't
  what is measured).

Run as root on a machine with containerd, runc and busybox-static:
    python benchmarks/crishim_latency.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from gpushare.pb import cri_pb2 as pb
from gpushare.pb import cri_pb2_grpc as pb_grpc
from gpushare.sandbox.containerd import TEST_IMAGE, containerd_available, running_containerd

TARGET_ADDED_P50_MS = 0.3
TARGET_THROUGHPUT_RATIO = 0.7

CALLS: dict[str, Callable[[pb_grpc.RuntimeServiceStub], object]] = {
    "Version": lambda stub: stub.Version(pb.VersionRequest(), timeout=10),
    "ListContainers": lambda stub: stub.ListContainers(pb.ListContainersRequest(), timeout=10),
}


def create_containers(address: str, count: int) -> None:
    stub = pb_grpc.RuntimeServiceStub(grpc.insecure_channel(address))
    sandbox = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="bench", namespace="default", uid="uid-bench"),
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=pb.NamespaceOption(network=pb.NODE))
        ),
    )
    sandbox_id = stub.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox), timeout=60).pod_sandbox_id
    for n in range(count):
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=f"c{n}"), image=pb.ImageSpec(image=TEST_IMAGE), command=["sleep", "1"]
        )
        stub.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox), timeout=60
        )


def start_shim(base: Path, runtime: str) -> tuple[subprocess.Popen[bytes], str]:
    socket = base / "shim.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "gpushare.cli", "--log-level", "WARNING", "cri-shim", "--node-name", "bench",
         "--gpus", "sim:1xA100-80GB:81920", "--no-api-fetch", "--metrics-port", "0",
         "--listen", f"unix://{socket}", "--runtime", runtime],
    )  # fmt: skip
    address = f"unix://{socket}"
    grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=30)
    return process, address


def latencies(address: str, call: str, iterations: int) -> list[float]:
    stub = pb_grpc.RuntimeServiceStub(grpc.insecure_channel(address))
    fn = CALLS[call]
    for _ in range(min(200, iterations)):
        fn(stub)
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn(stub)
        samples.append(time.perf_counter() - start)
    return samples


def _caller(address: str, call: str, seconds: float, ready: Any, results: Any) -> None:
    stub = pb_grpc.RuntimeServiceStub(grpc.insecure_channel(address))
    fn = CALLS[call]
    fn(stub)
    ready.wait()  # every caller connected before the clock starts
    done, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        fn(stub)
        done += 1
    results.put(done)


def throughput(address: str, call: str, concurrency: int, seconds: float) -> float:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ready = ctx.Barrier(concurrency)
    workers = [ctx.Process(target=_caller, args=(address, call, seconds, ready, results)) for _ in range(concurrency)]
    for worker in workers:
        worker.start()
    total = sum(results.get(timeout=seconds + 60) for _ in workers)
    for worker in workers:
        worker.join()
    return total / seconds


def percentile(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1] * 1000


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--containers", type=int, default=50)
    parser.add_argument("--iterations", type=int, default=1000, help="sequential calls per path and round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="throughput run per path and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the paths swap order every round")
    args = parser.parse_args()
    reason = containerd_available()
    if reason:
        print(f"can't run: {reason}", file=sys.stderr)
        return 2
    with running_containerd(Path(tempfile.mkdtemp(prefix="gs-bench-"))) as containerd:
        create_containers(containerd.address, args.containers)
        shim, shim_address = start_shim(containerd.base, containerd.address)
        try:
            targets = {"direct": containerd.address, "shim": shim_address}
            orders = [list(targets), list(reversed(targets))]
            samples: dict[tuple[str, str], list[float]] = {(c, p): [] for c in CALLS for p in targets}
            rates: dict[tuple[str, str], list[float]] = {(c, p): [] for c in CALLS for p in targets}
            shim_cpu: dict[str, list[float]] = {c: [] for c in CALLS}
            for round_ in range(args.rounds):
                for call in CALLS:
                    for path in orders[round_ % 2]:
                        samples[call, path] += latencies(targets[path], call, args.iterations)
                    for path in orders[round_ % 2]:
                        before = cpu_seconds(shim.pid)
                        rate = throughput(targets[path], call, args.concurrency, args.seconds)
                        rates[call, path].append(rate)
                        if path == "shim":
                            shim_cpu[call].append((cpu_seconds(shim.pid) - before) / (rate * args.seconds))
            report(args, samples, rates, shim_cpu)
        finally:
            shim.terminate()
            shim.wait(10)
    return 0


def report(
    args: argparse.Namespace,
    samples: dict[tuple[str, str], list[float]],
    rates: dict[tuple[str, str], list[float]],
    shim_cpu: dict[str, list[float]],
) -> None:
    print(
        f"{args.containers} containers; {args.rounds} rounds of {args.iterations} sequential calls per path "
        f"(paths alternate which goes first); latency in ms over all rounds"
    )
    print(f"{'call':<16}{'path':<8}{'p50':>8}{'p99':>8}")
    for call in CALLS:
        for path in ("direct", "shim"):
            got = samples[call, path]
            print(f"{call:<16}{path:<8}{percentile(got, 50):>8.3f}{percentile(got, 99):>8.3f}")
        added50 = percentile(samples[call, "shim"], 50) - percentile(samples[call, "direct"], 50)
        added99 = percentile(samples[call, "shim"], 99) - percentile(samples[call, "direct"], 99)
        verdict = "meets" if added50 <= TARGET_ADDED_P50_MS else "misses"
        target = f"({verdict} the p50 target of {TARGET_ADDED_P50_MS} ms)"
        print(f"{call:<16}{'added':<8}{added50:>8.3f}{added99:>8.3f}   {target}")
    print(f"\nthroughput at concurrency {args.concurrency}, calls/s: each round's, then the median")
    for call in CALLS:
        direct, shim = rates[call, "direct"], rates[call, "shim"]
        ratios = [s / d for s, d in zip(shim, direct, strict=True)]
        ratio = statistics.median(ratios)
        verdict = "meets" if ratio >= TARGET_THROUGHPUT_RATIO else "misses"
        print(
            f"{call:<16}direct {' '.join(f'{r:6.0f}' for r in direct)}  median {statistics.median(direct):6.0f}\n"
            f"{'':<16}shim   {' '.join(f'{r:6.0f}' for r in shim)}  median {statistics.median(shim):6.0f}   "
            f"shim/direct per round {' '.join(f'{r:.0%}' for r in ratios)}, median {ratio:.0%} "
            f"({verdict} the {TARGET_THROUGHPUT_RATIO:.0%} target); "
            f"shim CPU {statistics.median(shim_cpu[call]) * 1e6:.0f} us per call"
        )


if __name__ == "__main__":
    sys.exit(main())
