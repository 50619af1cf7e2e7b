"""Allocate latency with ``--pods`` pods on one node, and the gpu-mem ListAndWatch size per memory unit.

Runs the API server stand-in, the device plugin and a kubelet emulator in one process, on 8 simulated
cards of 141 GiB (144384 MiB). Each round creates ``--pods`` pending pods bound to the node, then
Allocates for each of them in turn (so every Allocate sees all of them in the node cache) and reports:
- decision latency: reading the node cache, matching, validating and building the answer, which is
  what Allocate does before it records the result on the pod;
- full latency: one Allocate gRPC call as kubelet makes it, the pod patch round-trip included.
Then prints the ListAndWatch message size for the same cards in each unit, and whether the plugin's
size guard lets that unit start.

    python benchmarks/allocate_latency.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from gpushare.deviceplugin.decision import decide
from gpushare.deviceplugin.devices import MAX_MESSAGE_BYTES, DeviceListTooLarge, check_message_size, message_size
from gpushare.deviceplugin.plugin import SOCKETS
from gpushare.deviceplugin.wiring import RunningPlugin, start_device_plugin
from kubernetes import client

from gpushare.cards import Card
from gpushare.contract.aliyun import format_assume_time, format_bool
from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_MEM_ASSIGNED,
    ANN_MEM_ASSUME_TIME,
    ANN_MEM_IDX,
    ENV_VISIBLE_DEVICES,
    RESOURCE_MEM,
)
from gpushare.contract.units import GIB, parse_unit
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.kube.transport import load_api
from gpushare.pb import deviceplugin_pb2 as pb
from gpushare.pb import deviceplugin_pb2_grpc as pb_grpc
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubeletemulator import KubeletEmulator
from gpushare.settings import NodeSettings

NODE = "n1"
SPEC = "8xH200:144384"
UNITS = ("GiB", "256MiB", "32MiB", "MiB")
TARGET_P99_MS = 10.0


def pod(name: str, card: Card, units: int, assume_ns: int) -> dict[str, Any]:
    allocation = {"main": (CardSlice(card.index, card.uuid, units),)}
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "annotations": {
                ANN_ALLOCATION: format_allocation(allocation),
                ANN_MEM_IDX: str(card.index),
                ANN_MEM_ASSIGNED: format_bool(False),
                ANN_MEM_ASSUME_TIME: format_assume_time(assume_ns),
            },
        },
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": {RESOURCE_MEM: str(units)}}}],
        },
    }


def wait_for(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)


def run_round(
    core: client.CoreV1Api, running: RunningPlugin, stub: pb_grpc.DevicePluginStub, cards: list[Card], count: int
) -> tuple[list[float], list[float]]:
    for existing in core.list_namespaced_pod("default").items:
        core.delete_namespaced_pod(existing.metadata.name, "default")
    wait_for(lambda: not running.cache.items(), "the node cache to empty")
    plan = [(f"p{n}", cards[n % len(cards)], 1 + n % 8, 1_000_000 + n) for n in range(count)]
    for name, card, units, assume in plan:
        core.create_namespaced_pod("default", pod(name, card, units, assume))
    wait_for(lambda: len(running.cache.items()) == count, f"{count} pods in the node cache")

    decisions, full = [], []
    for name, card, units, _ in plan:
        started = time.perf_counter()
        decision = decide(running.allocator.pods(), NODE, RESOURCE_MEM, units, cards, GIB)
        decisions.append(time.perf_counter() - started)
        assert decision.pod["metadata"]["name"] == name, (decision.pod["metadata"]["name"], name)
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["x"] * units)])
        started = time.perf_counter()
        reply = stub.Allocate(request, timeout=10)
        full.append(time.perf_counter() - started)
        assert reply.container_responses[0].envs[ENV_VISIBLE_DEVICES] == card.uuid
    return decisions, full


def percentiles(samples: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {
        "p50_ms": round(cuts[49] * 1000, 3),
        "p99_ms": round(cuts[98] * 1000, 3),
        "max_ms": round(max(samples) * 1000, 3),
    }


def listandwatch_sizes(cards: list[Card]) -> list[dict[str, Any]]:
    rows = []
    for name in UNITS:
        unit = parse_unit(name)
        try:
            check_message_size(cards, unit)
            verdict = "accepted"
        except DeviceListTooLarge as exc:
            verdict = f"refused: {exc}"
        devices = sum(unit.units_of(card.memory_mib) for card in cards)
        rows.append({"unit": name, "devices": devices, "bytes": message_size(cards, unit), "guard": verdict})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=110)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    server = ApiServer()
    server.start()
    workdir = Path(tempfile.mkdtemp(prefix="bench", dir="/tmp"))
    api = load_api(str(server.write_kubeconfig(workdir / "kubeconfig")))
    core = client.CoreV1Api(api)
    backend = SimulatedBackend(NODE, SPEC)
    cards = backend.cards()
    kubelet = KubeletEmulator(workdir)
    kubelet.start()
    settings = NodeSettings(NODE, None, f"sim:{SPEC}", workdir, GIB, frozenset())
    running = start_device_plugin(settings, backend, api)
    try:
        running.cache.wait_synced(10)
        kubelet.wait_registered(RESOURCE_MEM, 10)
        channel = grpc.insecure_channel(f"unix://{workdir / SOCKETS[RESOURCE_MEM]}")
        stub = pb_grpc.DevicePluginStub(channel)
        run_round(core, running, stub, cards, min(args.pods, 10))  # warm-up: connections, imports, caches
        decisions, full = [], []
        for _ in range(args.rounds):
            d, f = run_round(core, running, stub, cards, args.pods)
            decisions += d
            full += f
        channel.close()
    finally:
        running.stop()
        kubelet.stop()
        server.stop()

    decision = percentiles(decisions)
    report = {
        "node": f"{len(cards)} cards x {cards[0].memory_mib} MiB, {args.pods} pods on the node",
        "allocations": len(full),
        "decision_latency": decision,
        "full_latency_with_patch": percentiles(full),
        "target": f"decision p99 < {TARGET_P99_MS} ms: {'met' if decision['p99_ms'] < TARGET_P99_MS else 'MISSED'}",
        "listandwatch_limit_bytes": MAX_MESSAGE_BYTES,
        "listandwatch": listandwatch_sizes(cards),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
