"""What the CRI shim adds to a call: the same calls straight to containerd and through the shim, in one run.

Starts a private containerd with ``--containers`` containers, and the shim as its own process (as on a
node), then measures:
- p50 and p99 latency of Version and of ListContainers, one call at a time;
- throughput at ``--concurrency`` concurrent callers (separate processes, so the client's GIL isn't
  what is measured);
- p50 and p99 latency of StartContainer of a GPU container (``--starts`` a round per path, each on a
  container created just before, untimed): straight to containerd, through the shim above (which
  forwards it untouched), and through a second shim with memory limits on, on the fake libnvidia-ml
  (``gpushare/sandbox/fakenvml``, machine dgx-a100), which holds the call while it asks containerd what
  the container is, makes its cgroup and sets its limit (:mod:`gpushare.crishim.starting`). That shim
  makes its cgroups under the machine's cgroup2 mount (``--cgroup-root``), in
  ``gpushare-bench-PID``, removed afterwards.

Run as root on a machine with containerd, runc, busybox-static, gcc and a cgroup2 mount:
    python benchmarks/crishim_latency.py [--starts 20]
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

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.env import assigned_env, toolkit_memory_env
from gpushare.contract.names import ANN_ALLOCATION, CTR_ANN_CARDS, CTR_ANN_CONTAINER, CTR_ANN_POD, CTR_ANN_POD_UID
from gpushare.contract.units import GIB
from gpushare.memlimits.cgroups import detect_layout
from gpushare.pb import cri_pb2 as pb
from gpushare.pb import cri_pb2_grpc as pb_grpc
from gpushare.sandbox import cri_kubelet, fakenvml
from gpushare.sandbox.containerd import TEST_IMAGE, containerd_available, running_containerd
from gpushare.sandbox.nodecgroups import make_cgroup_root, remove_cgroup_root

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


def start_shim(
    base: Path,
    runtime: str,
    name: str = "shim",
    gpus: tuple[str, ...] = ("--gpus", "sim:1xA100-80GB:81920"),
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    socket = base / f"{name}.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "gpushare.cli", "--log-level", "WARNING", "cri-shim", "--node-name", "bench",
         *gpus, "--no-api-fetch", "--metrics-port", "0", "--listen", f"unix://{socket}", "--runtime", runtime],
        env=env,
    )  # fmt: skip
    address = f"unix://{socket}"
    grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=30)
    return process, address


# --- StartContainer of a GPU container ------------------------------------------------------------------------

FAKE_MACHINE = "dgx-a100"
START_PATHS = ("direct", "shim", "shim+limits")
#: the bench pod's UID (kubelet names its cgroup pod<UID>) and its GPU container's share of card 0
START_UID = "6e6e6e6e-0000-4000-8000-000000000001"
START_UNITS = 20


def first_card(machine: str) -> CardSlice:
    """``START_UNITS`` of the first card of a fake machine, whose description names its UUID."""
    lines = fakenvml.machine_file(machine).read_text().splitlines()
    uuid = next(line.split()[1] for line in lines if line.startswith("uuid "))
    return CardSlice(index=0, uuid=uuid, units=START_UNITS)


def gpu_sandbox(card: CardSlice, cgroup_parent: str) -> pb.PodSandboxConfig:
    """The pod sandbox as kubelet describes it: its allocation annotation gives its worker ``card``."""
    pod = {"metadata": {"name": "bench-gpu", "namespace": "default", "uid": START_UID}}
    pod["metadata"]["annotations"] = {ANN_ALLOCATION: format_allocation({"worker": (card,)})}
    config = cri_kubelet.sandbox_config(pod)
    config.linux.cgroup_parent = cgroup_parent
    return config


def gpu_container(card: CardSlice, attempt: int) -> pb.ContainerConfig:
    """The worker as kubelet creates it with the device plugin's answer for ``card``."""
    slices = (card,)
    env = assigned_env(slices, card.units, {card.uuid: 80}) | toolkit_memory_env(slices, GIB.mib)
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="worker", attempt=attempt),
        image=pb.ImageSpec(image=TEST_IMAGE),
        command=["sleep", "60"],
        envs=[pb.KeyValue(key=k, value=v) for k, v in env.items()],
        annotations={CTR_ANN_POD_UID: START_UID, CTR_ANN_POD: "default/bench-gpu", CTR_ANN_CONTAINER: "worker",
                     CTR_ANN_CARDS: card.uuid},
    )  # fmt: skip


Sandbox = tuple[str, pb.PodSandboxConfig]


def create_gpu_container(runtime: pb_grpc.RuntimeServiceStub, sandbox: Sandbox, card: CardSlice, attempt: int) -> str:
    config = gpu_container(card, attempt)
    request = pb.CreateContainerRequest(pod_sandbox_id=sandbox[0], config=config, sandbox_config=sandbox[1])
    return runtime.CreateContainer(request, timeout=60).container_id


def remove_container(runtime: pb_grpc.RuntimeServiceStub, container: str) -> None:
    runtime.StopContainer(pb.StopContainerRequest(container_id=container, timeout=0), timeout=60)
    runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=container), timeout=60)


def timed_starts(
    runtime: pb_grpc.RuntimeServiceStub, address: str, sandbox: Sandbox, card: CardSlice, calls: int, first: int
) -> list[float]:
    """``calls`` StartContainer calls on ``address``, each of a GPU container created (attempts from
    ``first`` on) and afterwards removed straight on containerd, untimed; seconds."""
    took = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        for attempt in range(first, first + calls):
            container = create_gpu_container(runtime, sandbox, card, attempt)
            started = time.perf_counter()
            stub.StartContainer(pb.StartContainerRequest(container_id=container), timeout=60)
            took.append(time.perf_counter() - started)
            remove_container(runtime, container)
    return took


def check_limited(fake: fakenvml.FakeNvml, card: CardSlice, pod: Path) -> None:
    """Stop unless the limits shim set the container's limit on a cgroup in ``pod``: its figures would
    otherwise be a plain forward's."""
    share = card.units * GIB.bytes
    if not any(
        uuid == card.uuid and Path(path).parent == pod and hard == share
        for (uuid, path), (_, hard) in fake.limits().items()
    ):
        raise SystemExit(f"the limits shim set no {share} B limit on a container cgroup in {pod}: {fake.limits()}")


def start_latencies(base: Path, runtime: str, plain_shim: str, rounds: int, calls: int) -> dict[str, list[float]] | str:
    """StartContainer latencies per path (see the module docstring), or why they can't be measured."""
    if reason := fakenvml.gcc_missing():
        return f"the fake libnvidia-ml can't be built: {reason}"
    cgroup2 = detect_layout(Path("/proc/self/mountinfo").read_text()).unified
    if cgroup2 is None:
        return "no cgroup2 mount to make the containers' cgroups in"
    made = make_cgroup_root(f"gpushare-bench-{os.getpid()}")  # in every hierarchy, as runc makes its cgroups
    bench = cgroup2 / made[0].name
    pod = bench / f"pod{START_UID}"
    pod.mkdir()  # kubelet's pod cgroup, there before its sandbox
    fake = fakenvml.prepare(FAKE_MACHINE, base)
    card = first_card(FAKE_MACHINE)
    gpus = ("--gpus", "nvml", "--cgroup-root", str(cgroup2))
    limited, limited_address = start_shim(base, runtime, "shim-limits", gpus, fake.env())
    channel = grpc.insecure_channel(runtime)
    stub = pb_grpc.RuntimeServiceStub(channel)
    sandbox_config = gpu_sandbox(card, f"/{bench.name}/{pod.name}")
    sandbox_id = stub.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config), timeout=60).pod_sandbox_id
    targets = {"direct": runtime, "shim": plain_shim, "shim+limits": limited_address}
    samples: dict[str, list[float]] = {path: [] for path in START_PATHS}
    sandbox = (sandbox_id, sandbox_config)
    try:
        warm = create_gpu_container(stub, sandbox, card, 0)
        with grpc.insecure_channel(limited_address) as limited_channel:
            request = pb.StartContainerRequest(container_id=warm)
            pb_grpc.RuntimeServiceStub(limited_channel).StartContainer(request, timeout=60)
        check_limited(fake, card, pod)
        remove_container(stub, warm)
        attempt = 1
        for round_ in range(rounds):
            order = START_PATHS[round_ % 3 :] + START_PATHS[: round_ % 3]
            for path in order:
                samples[path] += timed_starts(stub, targets[path], sandbox, card, calls, attempt)
                attempt += calls
    finally:
        stub.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
        stub.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
        channel.close()
        limited.terminate()
        limited.wait(10)
        remove_cgroup_root(made)
    return samples


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
    parser.add_argument("--starts", type=int, default=20, help="StartContainer calls per path and round (0: none)")
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
            if args.starts:
                starts = start_latencies(containerd.base, containerd.address, shim_address, args.rounds, args.starts)
                report_starts(args, starts)
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


def report_starts(args: argparse.Namespace, starts: dict[str, list[float]] | str) -> None:
    if isinstance(starts, str):
        print(f"\nStartContainer not measured: {starts}")
        return
    print(
        f"\nStartContainer of a GPU container ({START_UNITS} GiB of card 0 of the fake {FAKE_MACHINE}), "
        f"{args.rounds} rounds of {args.starts} per path (paths take turns going first); ms, from the client"
    )
    direct50 = percentile(starts["direct"], 50)
    print(f"{'path':<14}{'median':>9}{'p99':>9}{'added p50':>11}")
    for path in START_PATHS:
        got = starts[path]
        median, p99 = percentile(got, 50), percentile(got, 99)
        print(f"{path:<14}{median:>9.3f}{p99:>9.3f}{median - direct50:>11.3f}")


if __name__ == "__main__":
    sys.exit(main())
