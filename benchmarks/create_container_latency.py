"""What each way of enforcing the scheduler's card choice adds to CreateContainer, in one run: the same
CRI CreateContainer calls straight to containerd with no plugin, through the CRI shim (its own process,
as ``--enforcement=cri-shim`` runs it), and straight to containerd with gpushare's NRI plugin connected
(its own process, as ``--enforcement=nri`` runs it, on containerd's NRI socket).

Two kinds of container, each in its own pod sandbox made once: ``gpu``, whose device-plugin env and
annotations name the card its pod's allocation annotation assigns (the decision forwards it unchanged),
and ``plain``, which requests no GPU (the decision sets NVIDIA_VISIBLE_DEVICES=void). Each call is timed
from the client; the container is removed after, untimed. The paths take turns going first in each
round. Prints the median and p99 per path and kind, and each path's median over the direct one's.

Run as root on a machine with containerd 2.x, runc and busybox-static:
    python benchmarks/create_container_latency.py [--calls 20] [--rounds 15]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.env import assigned_env, toolkit_memory_env
from gpushare.contract.names import (
    ANN_ALLOCATION,
    CTR_ANN_CARDS,
    CTR_ANN_CONTAINER,
    CTR_ANN_POD,
    CTR_ANN_POD_UID,
    NRI_PLUGIN_INDEX,
    NRI_PLUGIN_NAME,
)
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.pb import cri_pb2 as pb
from gpushare.pb import cri_pb2_grpc as pb_grpc
from gpushare.sandbox import cri_kubelet
from gpushare.sandbox.containerd import TEST_IMAGE, containerd_available, running_containerd

NODE = "bench"
GPUS = "2xA100-80GB:81920"
CARDS = simulated_cards(NODE, GPUS)
KINDS = ("gpu", "plain")
PATHS = ("containerd", "cri-shim", "nri")


def pod_of(kind: str) -> dict[str, Any]:
    """The pod whose sandbox holds the ``kind`` containers, as kubelet would describe it."""
    annotations = {}
    if kind == "gpu":
        slices = (CardSlice(index=CARDS[0].index, uuid=CARDS[0].uuid, units=20),)
        annotations = {ANN_ALLOCATION: format_allocation({"worker": slices})}
    metadata = {"name": f"bench-{kind}", "namespace": "default", "uid": f"uid-{kind}", "annotations": annotations}
    return {"metadata": metadata}


def container_config(kind: str, attempt: int) -> pb.ContainerConfig:
    """A ``kind`` container named ``worker`` as kubelet builds it (its ``attempt``-th start, which keeps
    runtime names apart); a gpu one with the device plugin's answer for its pod."""
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="worker", attempt=attempt),
        image=pb.ImageSpec(image=TEST_IMAGE),
        command=["sleep", "60"],
    )
    if kind == "gpu":
        slices = (CardSlice(index=CARDS[0].index, uuid=CARDS[0].uuid, units=20),)
        units = {c.uuid: GIB.units_of(c.memory_mib) for c in CARDS}
        env = assigned_env(slices, 20, units) | toolkit_memory_env(slices, GIB.mib)
        config.envs.extend(pb.KeyValue(key=k, value=v) for k, v in env.items())
        config.annotations.update(
            {CTR_ANN_POD_UID: "uid-gpu", CTR_ANN_POD: "default/bench-gpu", CTR_ANN_CONTAINER: "worker",
             CTR_ANN_CARDS: CARDS[0].uuid}
        )  # fmt: skip
    return config


def start_shim(base: Path, runtime: str) -> tuple[subprocess.Popen[bytes], str]:
    socket = base / "shim.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "gpushare.cli", "--log-level", "WARNING", "cri-shim", "--node-name", NODE,
         "--gpus", f"sim:{GPUS}", "--no-api-fetch", "--metrics-port", "0",
         "--listen", f"unix://{socket}", "--runtime", runtime],
    )  # fmt: skip
    address = f"unix://{socket}"
    grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=30)
    return process, address


def run_plugin(nri_socket: str, runtime: str, ready: Any, stop: Any) -> None:
    """The NRI plugin as the node agent runs it (no API server: the sandbox's annotations decide)."""
    from gpushare.nriplugin.handler import Handler
    from gpushare.nriplugin.wiring import NriSettings, RunningPlugin, cri_evictor

    from gpushare.enforcement.decide import Enforcer
    from gpushare.enforcement.resolve import Resolver
    from gpushare.settings import RewriteOptions

    enforcer = Enforcer(Resolver(GIB, None), lambda: CARDS, GIB, RewriteOptions())
    handler = Handler(enforcer, cri_evictor(runtime), limiting=False)
    plugin = RunningPlugin(handler, NriSettings(nri_socket, NRI_PLUGIN_NAME, NRI_PLUGIN_INDEX)).start()
    try:
        deadline = time.monotonic() + 30
        while not plugin.ready():  # the child's own start-up, before the parent measures anything
            if time.monotonic() > deadline:
                raise SystemExit("the NRI plugin did not register within 30 s")
            time.sleep(0.05)
        ready.set()
        stop.wait()
    finally:
        plugin.stop()


Sandboxes = dict[str, tuple[str, pb.PodSandboxConfig]]


def timed_creates(address: str, sandboxes: Sandboxes, calls: int) -> dict[str, list[float]]:
    """``calls`` CreateContainer calls per kind on ``address``, each container removed after; seconds."""
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        for n in range(calls):
            for kind in KINDS:
                sandbox_id, sandbox = sandboxes[kind]
                request = pb.CreateContainerRequest(
                    pod_sandbox_id=sandbox_id, config=container_config(kind, n), sandbox_config=sandbox
                )
                started = time.perf_counter()
                created = stub.CreateContainer(request, timeout=30).container_id
                samples[kind].append(time.perf_counter() - started)
                stub.RemoveContainer(pb.RemoveContainerRequest(container_id=created), timeout=30)
    return samples


def percentile_ms(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20, help="calls per path, kind and round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds; the paths take turns going first")
    args = parser.parse_args()
    reason = containerd_available()
    if reason:
        print(f"can't run: {reason}", file=sys.stderr)
        return 2
    context = multiprocessing.get_context("spawn")
    # overlayfs, as on a node: the native snapshotter's copy of the image per container would dwarf the rest
    with running_containerd(Path(tempfile.mkdtemp(prefix="gs-bench-")), snapshotter="overlayfs") as containerd:
        cri = cri_kubelet.CriRuntime(containerd.address)
        sandboxes = {}
        for kind in KINDS:
            config = cri_kubelet.sandbox_config(pod_of(kind))
            reply = cri.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=60)
            sandboxes[kind] = (reply.pod_sandbox_id, config)
        shim, shim_address = start_shim(containerd.base, containerd.address)
        ready, stop = context.Event(), context.Event()
        samples = {(path, kind): [] for path in PATHS for kind in KINDS}
        try:
            for round_ in range(args.rounds):
                order = PATHS[round_ % len(PATHS) :] + PATHS[: round_ % len(PATHS)]
                for path in order:
                    if path == "nri":  # connected for its turn only: the other paths run without it
                        plugin = context.Process(
                            target=run_plugin, args=(str(containerd.nri_socket), containerd.address, ready, stop)
                        )
                        ready.clear()
                        stop.clear()
                        plugin.start()
                        if not ready.wait(60):
                            raise SystemExit("the NRI plugin did not start")
                    address = shim_address if path == "cri-shim" else containerd.address
                    try:
                        for kind, got in timed_creates(address, sandboxes, args.calls).items():
                            samples[path, kind] += got
                    finally:
                        if path == "nri":
                            stop.set()
                            plugin.join(30)
        finally:
            stop.set()
            shim.terminate()
            shim.wait(10)
            cri.close()
    report(args, samples)
    return 0


def report(args: argparse.Namespace, samples: dict[tuple[str, str], list[float]]) -> None:
    print(f"CreateContainer, {args.rounds} rounds x {args.calls} calls per path and kind; ms, from the client")
    print(f"{'kind':<7}{'path':<12}{'median':>9}{'p99':>9}{'median / containerd':>22}")
    for kind in KINDS:
        direct = statistics.median(samples["containerd", kind])
        for path in PATHS:
            got = samples[path, kind]
            median = statistics.median(got)
            print(f"{kind:<7}{path:<12}{median * 1000:>9.2f}{percentile_ms(got, 99):>9.2f}{median / direct:>21.2f}x")


if __name__ == "__main__":
    sys.exit(main())
