"""Extender latency at scale: filter+prioritize per pod over 5,000 nodes x 8 cards, and bind throughput.

    python benchmarks/extender_latency.py [--nodes 5000] [--running 10000] [--pods 300] [--policy fgd]
        [--scrapers 4]

Everything runs as deployed: the API stand-in and the extender are separate processes
(``gpushare apiserver``, ``gpushare extender``); nodes and pods live in the stand-in, the extender watches
them, and this script calls the verbs with kube-scheduler's JSON (NodeNames mode) over one keep-alive
connection, as kube-scheduler does.

The cluster first gets ``--running`` pods already bound with their cards (what a scheduler that has been
running for a while leaves behind), so the fragmentation-aware policy has a settled workload. Each
demand shape is then asked once untimed (a running scheduler has seen every common shape), and those
first answers are reported separately as the cold figure. Then ``--pods`` pods go through filter,
prioritize and bind one after another; each bind changes one node, whose memoised answers the next pod
recomputes.

With ``--scrapers N``, the pods go in rounds of ``--round`` pods, every other round while N scrapers
(another process, at the lowest CPU priority) read the extender's /metrics over and over on its health
port, as Prometheus does and as anyone who reaches that port can; filter+prioritize is reported for the
rounds with and without them, side by side, so both see the same machine, and so is the extender's CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import ANN_ALLOCATION, NODE_ANN_INVENTORY, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.kube.objects import get_pod
from gpushare.kube.transport import load_api

CARD_UNITS = 80
#: (gpu-mem, gpu-count) with how often each occurs: mostly small shared pods, some whole cards
SHAPES = {(1, 0): 6, (2, 0): 6, (4, 0): 5, (8, 0): 4, (16, 0): 3, (40, 0): 2, (8, 2): 1, (0, 1): 2, (0, 2): 1}


class Verbs:
    """One keep-alive connection per thread to the extender."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._local = threading.local()

    def post(self, verb: str, body: object) -> Any:
        return json.loads(self.exchange(verb, json.dumps(body).encode())[0])

    def exchange(self, verb: str, data: bytes) -> tuple[bytes, float]:
        """The reply's bytes, and the seconds from sending the request to having the whole reply."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=60)
        began = time.perf_counter()
        conn.request("POST", f"/{verb}", body=data, headers={"Content-Type": "application/json"})
        reply = conn.getresponse().read()
        return reply, time.perf_counter() - began

    def bind(self, pod: dict[str, Any], node: str) -> str:
        meta = pod["metadata"]
        args = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}
        return self.post("bind", args)["Error"]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def pod_body(name: str, mem: int, count: int) -> dict[str, Any]:
    limits = {}
    if mem:
        limits[RESOURCE_MEM] = str(mem)
    if count:
        limits[RESOURCE_COUNT] = str(count)
    return {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits}}]},
    }


def running_pod(name: str, node: str, uuids: list[str], free: list[int], shape: tuple[int, int]) -> dict | None:
    """A pod bound to ``node`` with its cards annotated (first fit), or None if it doesn't fit there."""
    mem, count = shape
    cards, per_card = max(count, 1), (mem // count if count else mem)
    need = CARD_UNITS if count and not mem else per_card
    chosen = [i for i, f in enumerate(free) if f >= need and (need < CARD_UNITS or f == CARD_UNITS)][:cards]
    if len(chosen) < cards:
        return None
    for i in chosen:
        free[i] -= need
    slices = tuple(CardSlice(i, uuids[i], need) for i in chosen)
    pod = pod_body(name, mem, count)
    pod["spec"]["nodeName"] = node
    pod["metadata"]["annotations"] = {ANN_ALLOCATION: format_allocation({"main": slices})}
    return pod


def fill(core: client.CoreV1Api, names: list[str], uuids: dict[str, list[str]], count: int, rng: random.Random) -> int:
    free = {name: [CARD_UNITS] * 8 for name in names}
    shapes, weights = list(SHAPES), list(SHAPES.values())
    created = 0
    for i in range(count):
        node = rng.choice(names)
        pod = running_pod(f"r{i:06d}", node, uuids[node], free[node], rng.choices(shapes, weights)[0])
        if pod is not None:
            core.create_namespaced_pod("default", pod)
            created += 1
    return created


def pending(api: client.ApiClient, core: client.CoreV1Api, name: str, shape: tuple[int, int]) -> dict[str, Any]:
    core.create_namespaced_pod("default", pod_body(name, *shape))
    return get_pod(api, "default", name)


def schedule(verbs: Verbs, pod: dict[str, Any], names: list[str]) -> tuple[float, float, str | None]:
    """filter then prioritize; the seconds each took on the wire and in the extender (this script's own
    JSON encoding and decoding not counted), and the best node."""
    reply, spent_filter = verbs.exchange("filter", json.dumps({"Pod": pod, "NodeNames": names}).encode())
    candidates = json.loads(reply)["NodeNames"]
    if not candidates:
        return spent_filter, 0.0, None
    reply, spent_prioritize = verbs.exchange("prioritize", json.dumps({"Pod": pod, "NodeNames": candidates}).encode())
    scored = json.loads(reply)  # nodes scoring 0 are left out
    best = max(scored, key=lambda s: (s["Score"], s["Host"]))["Host"] if scored else max(candidates)
    return spent_filter, spent_prioritize, best


def scrape(port: int, scrapers: int, stop: Any, scrapes: Any) -> None:
    """``scrapers`` threads reading /metrics over keep-alive connections until ``stop`` is set; the
    number of scrapes is added to ``scrapes``. Runs in a process of its own at the lowest priority, so
    that reading the replies takes no core from the extender and the process that times the verbs, as
    when Prometheus runs on another machine."""
    os.nice(19)

    def loop() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.is_set():
            conn.request("GET", "/metrics")
            conn.getresponse().read()
            with scrapes.get_lock():
                scrapes.value += 1

    threads = [threading.Thread(target=loop) for _ in range(scrapers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@contextlib.contextmanager
def scraping(port: int, scrapers: int) -> Any:
    """``scrapers`` concurrent scrapers of the health port while the block runs (none: nothing); yields
    a counter of the scrapes done."""
    context = multiprocessing.get_context("spawn")
    stop, scrapes = context.Event(), context.Value("i", 0)
    if not scrapers:
        yield scrapes
        return
    proc = context.Process(target=scrape, args=(port, scrapers, stop, scrapes), daemon=True)
    proc.start()
    wait_for(lambda: scrapes.value >= scrapers, "the scrapers' first replies")
    try:
        yield scrapes
    finally:
        stop.set()
        proc.join(60)


def report(label: str, samples: list[float]) -> None:
    p50, p99 = statistics.median(samples) * 1e3, percentile(samples, 0.99) * 1e3
    print(f"{label:>20} {p50:8.2f} {p99:8.2f} {max(samples) * 1e3:8.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--running", type=int, default=10000, help="pods already bound before measuring")
    parser.add_argument("--pods", type=int, default=300, help="pods scheduled while measuring")
    parser.add_argument("--binds", type=int, default=200, help="pods for the bind-throughput runs")
    parser.add_argument("--policy", default="fgd")
    parser.add_argument(
        "--scrapers", type=int, default=0, help="also measure with this many concurrent /metrics scrapers"
    )
    parser.add_argument("--round", type=int, default=25, help="pods per round with --scrapers")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs) afterwards")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rng = random.Random(7)

    workdir = Path(tempfile.mkdtemp(prefix="extbench"))
    kubeconfig = workdir / "kubeconfig"
    with contextlib.ExitStack() as stack:
        # registered first, so it runs last: after the processes writing there have stopped
        stack.callback(lambda: print(f"logs in {workdir}") if args.keep else shutil.rmtree(workdir, ignore_errors=True))
        serve(stack, workdir / "apiserver.log", "apiserver", "--port", str(free_port()), "--kubeconfig-out", kubeconfig)
        wait_for(kubeconfig.exists, "the API stand-in to write its kubeconfig")
        api = load_api(str(kubeconfig))
        core = client.CoreV1Api(api)
        started = time.perf_counter()
        names = [f"node-{i:05d}" for i in range(args.nodes)]
        uuids = {}
        for name in names:
            cards = simulated_cards(name, f"8xA100-80GB:{CARD_UNITS * 1024}")
            uuids[name] = [card.uuid for card in cards]
            annotations = {NODE_ANN_INVENTORY: format_inventory(cards, GIB)}
            core.create_node({"metadata": {"name": name, "annotations": annotations}})
        placed = fill(core, names, uuids, args.running, rng)
        print(f"{args.nodes} nodes x 8 cards and {placed} running pods created in {time.perf_counter() - started:.1f}s")

        port, health_port = free_port(), free_port()
        started = time.perf_counter()
        extender_args = ("extender", "--port", str(port), "--kubeconfig", kubeconfig, "--policy", args.policy)
        extender = serve(stack, workdir / "extender.log", *extender_args, "--health-port", str(health_port))
        wait_for(lambda: ready(port), "the extender to become ready")
        print(f"extender ready in {time.perf_counter() - started:.1f}s")
        return measure(args, api, core, names, placed, Verbs(port), rng, (health_port, extender.pid))


def measure(
    args: argparse.Namespace,
    api: client.ApiClient,
    core: client.CoreV1Api,
    names: list[str],
    placed: int,
    verbs: Verbs,
    rng: random.Random,
    extender: tuple[int, int],
) -> int:
    """``extender``: its health port and its process id."""
    health_port, pid = extender
    cold = []
    for i, shape in enumerate(SHAPES):
        spent = schedule(verbs, pending(api, core, f"w{i:02d}", shape), names)
        cold.append(spent[0] + spent[1])
    filters, prioritizes, totals = [], [], []
    #: filter+prioritize by the number of scrapers running meanwhile
    by_scrapers: dict[int, list[float]] = {0: [], args.scrapers: []}
    #: the extender's CPU seconds and the wall seconds, by the number of scrapers
    busy = {0: [0.0, 0.0], args.scrapers: [0.0, 0.0]}
    scrapes = 0
    shapes, weights = list(SHAPES), list(SHAPES.values())
    step = args.round if args.scrapers else args.pods
    for first in range(0, args.pods, step):
        scrapers = args.scrapers if (first // step) % 2 else 0
        with scraping(health_port, scrapers) as scraped:
            cpu, wall = cpu_seconds(pid), time.perf_counter()
            for i in range(first, min(first + step, args.pods)):
                pod = pending(api, core, f"p{i:05d}", rng.choices(shapes, weights)[0])
                spent_filter, spent_prioritize, best = schedule(verbs, pod, names)
                filters.append(spent_filter)
                prioritizes.append(spent_prioritize)
                totals.append(spent_filter + spent_prioritize)
                by_scrapers[scrapers].append(spent_filter + spent_prioritize)
                if best is None or (error := verbs.bind(pod, best)):
                    name = pod["metadata"]["name"]
                    print(f"pod {name} not placed: {error if best else 'no node fits'}", file=sys.stderr)
                    return 1
            busy[scrapers][0] += cpu_seconds(pid) - cpu
            busy[scrapers][1] += time.perf_counter() - wall
            scrapes += scraped.value

    print(f"\n{args.nodes} nodes x 8 cards, {placed} running pods, policy {args.policy}, HTTP (NodeNames mode)")
    print(f"{'':>20} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    report(f"filter ({args.pods})", filters)
    report(f"prioritize ({args.pods})", prioritizes)
    report(f"filter+prioritize ({args.pods})", totals)
    report(f"cold, 1st of shape ({len(cold)})", cold)
    if args.scrapers:
        print(f"\nfilter+prioritize in alternate rounds of {args.round} pods ({scrapes} scrapes in all)")
        for scrapers, samples in by_scrapers.items():
            report(f"{scrapers} scrapers ({len(samples)})", samples)
        cores = {scrapers: f"{cpu / wall:.2f}" for scrapers, (cpu, wall) in busy.items()}
        print(f"the extender's CPU, in cores, by scrapers: {cores}")

    batch = [pending(api, core, f"b{i:05d}", (4, 0)) for i in range(args.binds)]
    half = args.binds // 2
    began = time.perf_counter()
    errors = [verbs.bind(pod, names[0]) for pod in batch[:half]]
    one_node = half / (time.perf_counter() - began)
    began = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        errors += list(pool.map(verbs.bind, batch[half:], names[1 : 1 + args.binds - half]))
    spread = (args.binds - half) / (time.perf_counter() - began)
    if any(errors):
        print(f"bind failed: {next(e for e in errors if e)}", file=sys.stderr)
        return 1
    print(
        f"\nbind throughput through the API stand-in: {one_node:.0f} binds/s one after another onto one node, "
        f"{spread:.0f} binds/s with 8 concurrent binds onto different nodes"
    )
    return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(stack: contextlib.ExitStack, log: Path, *command: str | Path) -> subprocess.Popen[bytes]:
    """Run one ``gpushare`` subcommand until the benchmark ends."""
    out = stack.enter_context(log.open("w"))
    proc = subprocess.Popen([sys.executable, "-m", "gpushare.cli", *map(str, command)], stdout=out, stderr=out)
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    return proc


def cpu_seconds(pid: int) -> float:
    """CPU time the process has used, user and system (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
