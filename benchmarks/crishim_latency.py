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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--containers", type=int, default=50)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
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
            print(f"{args.containers} containers, {args.iterations} sequential calls, latency in ms")
            print(f"{'call':<16}{'path':<8}{'p50':>8}{'p99':>8}")
            for call in CALLS:
                measured = {path: latencies(address, call, args.iterations) for path, address in targets.items()}
                for path, samples in measured.items():
                    print(f"{call:<16}{path:<8}{percentile(samples, 50):>8.3f}{percentile(samples, 99):>8.3f}")
                added50 = percentile(measured["shim"], 50) - percentile(measured["direct"], 50)
                added99 = percentile(measured["shim"], 99) - percentile(measured["direct"], 99)
                verdict = "meets" if added50 <= TARGET_ADDED_P50_MS else "misses"
                print(
                    f"{call:<16}{'added':<8}{added50:>8.3f}{added99:>8.3f}"
                    f"   ({verdict} the p50 target of {TARGET_ADDED_P50_MS} ms)"
                )
            print(f"\nthroughput at concurrency {args.concurrency} ({args.seconds:.0f}s each), calls/s")
            for call in CALLS:
                rates = {
                    path: throughput(address, call, args.concurrency, args.seconds) for path, address in targets.items()
                }
                ratio = rates["shim"] / rates["direct"]
                print(
                    f"{call:<16}direct {rates['direct']:>8.0f}   shim {rates['shim']:>8.0f}   ({ratio:.0%} of direct)"
                )
        finally:
            shim.terminate()
            shim.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
