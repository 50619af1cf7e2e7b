"""Allocate latency with a full node (110 pods), and the ListAndWatch message size per memory unit.

Run: python benchmarks/allocate_latency.py [--pods 110]

Two latencies are reported, side by side from one run:
- decision: matching + validation over the node's 110 pods (what Allocate costs apart from the patch);
- full: kubelet emulator -> gRPC over a unix socket -> Allocate -> API patch -> answer.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kubernetes import client

from deviceplugin.allocate import decide
from deviceplugin.devices import MAX_MESSAGE_BYTES, DeviceListTooLarge, check_message_size, message_size
from deviceplugin.runtime import start_device_plugin
from gpushare import contract as c
from gpushare.cli import NodeSettings
from gpushare.inventory import SimulatedBackend, simulated_cards
from gpushare.kube import load_api
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubelet import KubeletEmulator

H200_SPEC = "8xH200:144384"  # 8 cards of 141 GiB


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def pod(i: int, card: c.CardSlice) -> dict:
    return {
        "metadata": {
            "name": f"p{i:03d}",
            "namespace": "default",
            "annotations": {
                c.ANN_ALLOCATION: c.format_allocation({"main": (card,)}),
                c.ANN_MEM_IDX: str(card.index),
                c.ANN_MEM_ASSIGNED: "false",
                c.ANN_MEM_ASSUME_TIME: str(1_700_000_000_000_000_000 + i),
            },
        },
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": {c.RESOURCE_MEM: "8"}}}],
        },
    }


def message_sizes() -> None:
    cards = simulated_cards("n1", H200_SPEC)
    print(f"\nListAndWatch message for aliyun.com/gpu-mem, {H200_SPEC} (limit {MAX_MESSAGE_BYTES:,} bytes)")
    print(f"{'unit':>8} {'devices':>9} {'bytes':>11}  verdict")
    for unit in (c.MemoryUnit(1), c.MemoryUnit(64), c.MemoryUnit(256), c.GIB):
        devices = sum(unit.units_of(card.memory_mib) for card in cards)
        try:
            check_message_size(cards, unit)
            verdict = "ok"
        except DeviceListTooLarge as exc:
            verdict = f"refused: {str(exc).split('; ')[-1]}"
        print(f"{unit.name:>8} {devices:>9,} {message_size(cards, unit):>11,}  {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=110)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    server = ApiServer()
    server.start()
    workdir = Path(tempfile.mkdtemp(prefix="bench", dir="/tmp"))
    try:
        api = load_api(str(server.write_kubeconfig(workdir / "kubeconfig")))
        core = client.CoreV1Api(api)
        backend = SimulatedBackend("n1", H200_SPEC)
        cards = backend.cards()
        kubelet = KubeletEmulator(workdir)
        kubelet.start()
        running = start_device_plugin(NodeSettings("n1", None, "sim", workdir, c.GIB, frozenset()), backend, api)
        kubelet.wait_for(lambda k: k.registered(c.RESOURCE_MEM), 10)
        for i in range(args.pods):
            core.create_namespaced_pod("default", pod(i, c.CardSlice(i % 8, cards[i % 8].uuid, 8)))
        deadline = time.monotonic() + 30
        while len(running.cache.items()) < args.pods and time.monotonic() < deadline:
            time.sleep(0.05)

        decision, full = [], []
        for i in range(args.pods):
            pods = running.cache.items()
            started = time.perf_counter()
            decide(pods, "n1", c.RESOURCE_MEM, 8, cards, c.GIB)
            decision.append(time.perf_counter() - started)
            target = running.cache.get(f"p{i:03d}", "default")
            started = time.perf_counter()
            admission = kubelet.admit(target)
            full.append(time.perf_counter() - started)
            if not admission.admitted:
                print(f"pod {i} not admitted: {admission.error}", file=sys.stderr)
                return 1
        print(f"Allocate with {args.pods} pods on the node ({H200_SPEC}), {args.pods} calls")
        print(f"{'':>28} {'p50 ms':>8} {'p99 ms':>8}")
        for label, samples in (("decision (no API patch)", decision), ("full gRPC + patch", full)):
            print(f"{label:>28} {statistics.median(samples) * 1e3:8.2f} {percentile(samples, 0.99) * 1e3:8.2f}")
        running.stop()
        kubelet.stop()
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    message_sizes()
    return 0


if __name__ == "__main__":
    sys.exit(main())
