"""Pods bound per second by the real kube-scheduler: alone, with the gpushare extender, with Alibaba's
extender, and with the pods' GPUs asked as DRA claims.

    python benchmarks/scheduler_throughput.py [--nodes 1000,5000] [--pods 800] [--rounds 3] [--qps 1000]
                                              [--gpus 4xA100-80GB:81920] [--aliyun-src DIR]
                                              [--calls] [--pin] [--profile DIR] [--pprof DIR]

Root and the built Kubernetes binaries are needed (see the README). One etcd and kube-apiserver serve
every round; no kubelets run: the nodes are Node objects carrying the advertiser's inventory annotation
and, in their status, what kubelet and the device plugin would report (cpu, memory, pods,
``aliyun.com/gpu-mem`` in units, ``aliyun.com/gpu-count`` as one replica per unit of each card), and each
has the ResourceSlice its node agent publishes with ``--dra`` (the DeviceClass is
``deploy/dra/deviceclass.yaml``). The pods each ask one share of a card (1 to 16 GiB, in turn). The setups:

- **plain**: kube-scheduler alone, the same pods without GPUs: the baseline.
- **gpushare**: the pods' ``aliyun.com/gpu-mem`` limits; kube-scheduler with
  ``deploy/scheduler-config.yaml``'s extender block; the extender as its own process on loopback (plain
  HTTP).
- **Alibaba**: the same limits; kube-scheduler with Alibaba's extender (filter and bind), built with the
  Go on PATH from the checkout ``--aliyun-src`` names, its client rate limit (hard-coded to client-go's
  5 requests/s) lifted to ``--qps`` by an overlay of its ``cmd/main.go`` for that build only
  (:mod:`aliyun` says how and why, and prints the change). Skipped, with one line, without
  ``--aliyun-src``. For this setup the nodes' ``gpu-count`` is their number of cards, as Alibaba's
  device plugin reports it (Alibaba's extender reads it so; the gpushare extender reads the annotation).
- **DRA**: each pod with its own ResourceClaim of ``gpu.gpushare.io`` for its share's memory;
  kube-scheduler without an extender.

Each round measures every setup, the order reversing from round to round: the pods (and claims) are
created first, then the setup's extender, then kube-scheduler (its client rate limit, ``qps`` and
``burst``, at ``--qps`` in every setup: at its default of 50 requests/s the plain scheduler's own
binding calls are what limits it); the rate is the pods bound after the first one over the time from
the first binding to the last, as a watch in this script sees them, and the CPU is that of every process
(etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the extender) from kube-scheduler's start
to the last binding, per pod. kube-scheduler and the extender are then stopped and the pods (and claims)
deleted, so no extender sees another setup's pods. The table gives each setup's medians and its rate as a
share of plain's. kube-controller-manager runs without its node lifecycle controller: no kubelet
heartbeats these nodes, so it would otherwise mark them unreachable mid-run.

``--nodes`` takes several sizes: the cluster grows to each in turn and every setup is measured there.
``--calls`` has kube-apiserver audit kube-scheduler's and the extender's requests and reports them per pod
bound (auditing costs the API server a little, so the rates of such a run are not the headline figures;
Alibaba's extender uses the gpushare extender's user, so its requests are counted under that name).
``--profile DIR`` samples the gpushare extender with py-spy during its runs and prints the top of each
profile; ``--pprof DIR`` writes kube-apiserver's and kube-scheduler's CPU profiles of each run (``go tool
pprof -top FILE``).
``--pin`` runs the control plane (and this script) on the first CPU and the extender on the second, as
when the extender runs as a Deployment of its own: its CPU then doesn't compete with kube-scheduler's
and kube-apiserver's, and the ratio shows what it costs them and the scheduling cycle. Without it,
everything shares every CPU, and on a small machine the ratio is mostly the CPU each setup needs per
pod.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aliyun
import yaml
from dra_replay import DEVICE_CLASS
from gpushare.advertiser.resourceslice import resource_slice
from kubernetes import client, utils
from nodeless import (
    NAMESPACE,
    RUN_LABEL,
    create_nodes,
    delete_run_claims,
    delete_run_pods,
    pod_body,
    scheduler_config,
    start_extender,
    start_scheduler,
)
from profiling import sampled, top
from prometheus_client.parser import text_string_to_metric_families
from realbench import real_cluster

from gpushare.contract.names import ANN_ALLOCATION, ANN_MEM_IDX
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.kube.watch import WatchCache
from gpushare.sandbox.binaries import KUBE_VERSION
from gpushare.sandbox.launch import ClusterError, Process, http_status, loopback_get, wait_for
from gpushare.sandbox.realcluster import RealCluster
from gpushare.simulate.kubereplay import GpuAsk, dra_claim_spec, extender_limits

#: GiB of one card the pods ask for, in turn
SHARES_GIB = (1, 2, 4, 8, 2, 16, 8, 4)
BIND_TIMEOUT = 600.0
PLAIN, GPUSHARE, ALIYUN, DRA = "plain", "gpushare", "Alibaba", "DRA"
LABELS = {
    PLAIN: "kube-scheduler alone (pods without GPUs)",
    GPUSHARE: "+ gpushare's extender",
    ALIYUN: "+ Alibaba's extender",
    DRA: "kube-scheduler alone, DRA claims of gpu.gpushare.io",
}
#: the annotation each extender leaves on every pod it binds
PLACED_BY = {GPUSHARE: ANN_ALLOCATION, ALIYUN: ANN_MEM_IDX}
#: whose requests --calls counts: what binding a pod costs the API server in each setup
CALLERS = ("system:kube-scheduler", "gpushare-extender")


class BindTimes:
    """When each pod of one run was first seen bound, from a watch."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, _kind: str, pod: dict[str, Any]) -> None:
        if (pod.get("spec") or {}).get("nodeName"):
            with self._lock:
                self.times.setdefault(pod["metadata"]["name"], time.monotonic())

    def count(self) -> int:
        with self._lock:
            return len(self.times)

    def rate(self) -> float:
        stamps = sorted(self.times.values())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class Extender:
    """The gpushare extender process, and where its profiles go (None: not profiled)."""

    def __init__(self, process: Process, url: str, profiles: Path | None) -> None:
        self.process, self.url, self.profiles = process, url, profiles

    def verb_seconds(self) -> dict[str, tuple[float, float]]:
        """Per verb, the extender's (calls, seconds answering them) so far, from its /metrics."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        totals: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            if family.name != "gpushare_extender_verb_seconds":
                continue
            for sample in family.samples:
                slot = {"gpushare_extender_verb_seconds_count": 0, "gpushare_extender_verb_seconds_sum": 1}
                if sample.name in slot:
                    totals.setdefault(sample.labels["verb"], [0.0, 0.0])[slot[sample.name]] = sample.value
        return {verb: (calls, seconds) for verb, (calls, seconds) in totals.items()}

    def sampled(self, run: str) -> contextlib.AbstractContextManager[None]:
        if self.profiles is None:
            return contextlib.nullcontext()
        return sampled(self.process.pid, self.profiles / f"{run}.txt")

    def report(self, before: dict[str, tuple[float, float]]) -> None:
        spent = []
        for verb, (count, seconds) in sorted(self.verb_seconds().items()):
            count0, seconds0 = before.get(verb, (0.0, 0.0))
            if count > count0:
                spent.append(f"{verb} {1000 * (seconds - seconds0) / (count - count0):.2f} ms x{count - count0:.0f}")
        print(f"  extender, mean time per call: {'; '.join(spent)}", flush=True)


@dataclass(frozen=True, slots=True)
class Run:
    rate: float
    #: CPU of every process per pod bound, in ms
    cpu_ms: float
    calls: Counter[str]


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pprof_cpu(server: str, token: str, out: Path, seconds: int) -> None:
    """A Kubernetes component's CPU profile over the next ``seconds`` (its /debug/pprof, on by default),
    for ``go tool pprof -top``."""
    with loopback_get(f"{server}/debug/pprof/profile?seconds={seconds}", token, seconds + 30) as reply:
        out.write_bytes(reply.read())


def audited_calls(log: Path, offset: int) -> Counter[str]:
    """Requests but watches of :data:`CALLERS` the audit log has after ``offset``, as ``"user verb resource"``."""
    calls: Counter[str] = Counter()
    with log.open("rb") as lines:
        lines.seek(offset)
        for line in lines:
            event = json.loads(line)
            user = event.get("user", {}).get("username")
            # not the watches each client keeps open
            if user in CALLERS and event.get("stage") == "ResponseComplete" and event["verb"] != "watch":
                ref = event.get("objectRef") or {}
                resource = "/".join(filter(None, (ref.get("resource"), ref.get("subresource"))))
                calls[f"{user} {event['verb']} {resource}"] += 1
    return calls


class Bench:
    """The cluster and what every run of every setup needs."""

    def __init__(
        self, cluster: RealCluster, pool: ThreadPoolExecutor, args: argparse.Namespace, aliyun_binary: Path | None
    ) -> None:
        self.cluster, self.pool, self.args, self.aliyun_binary = cluster, pool, args, aliyun_binary
        self.core = client.CoreV1Api(cluster.api)
        self.resource = client.ResourceV1Api(cluster.api)
        self.pinned = ["taskset", "--cpu-list", str(args.extender_cpu)] if args.pin else []

    def setups(self) -> list[str]:
        return [setup for setup in LABELS if setup != ALIYUN or self.aliyun_binary is not None]

    def grow(self, nodes: Sequence[tuple[str, str]]) -> None:
        """Nodes ``(name, cards)``, with their ResourceSlices (and gpu-count in cards, for Alibaba's extender)."""
        create_nodes(self.core, self.pool, nodes)
        slices = (resource_slice(name, simulated_cards(name, spec), GIB, 1) for name, spec in nodes)
        list(self.pool.map(self.resource.create_resource_slice, slices))
        if self.aliyun_binary is not None:
            aliyun.count_cards(self.core, self.pool, nodes)

    def create(self, setup: str, run: str, ask: GpuAsk) -> None:
        """The pod of ``ask`` as ``setup`` asks for it (with its ResourceClaim for DRA)."""
        if setup == DRA:
            claim = {
                "metadata": {"name": ask.pod, "namespace": NAMESPACE, "labels": {RUN_LABEL: run}},
                "spec": dra_claim_spec(ask, ()),
            }
            self.resource.create_namespaced_resource_claim(NAMESPACE, claim)
            self.core.create_namespaced_pod(NAMESPACE, pod_body(ask.pod, run, {}, claim=ask.pod))
            return
        limits = {} if setup == PLAIN else extender_limits(ask)
        self.core.create_namespaced_pod(NAMESPACE, pod_body(ask.pod, run, limits))

    def start_extender(self, setup: str, run: str) -> tuple[Process | None, str | None]:
        if setup == GPUSHARE:
            return start_extender(self.cluster, f"extender-{run}", self.args.policy, self.pinned)
        if setup == ALIYUN and self.aliyun_binary is not None:
            return aliyun.start(self.cluster, f"aliyun-{run}", self.aliyun_binary, self.pinned)
        return None, None

    def scheduler_config(self, setup: str, url: str | None) -> str:
        if setup != ALIYUN or url is None:
            return scheduler_config(self.cluster, url, self.args.qps)
        config = yaml.safe_load(scheduler_config(self.cluster, None, self.args.qps))
        config["extenders"] = [aliyun.extender_entry(url)]
        return yaml.safe_dump(config, sort_keys=False)

    def run(self, setup: str, run: str) -> Run:
        """Create the pods, start the extender and kube-scheduler, wait for every binding; the rate, the
        CPU per pod, and the audited requests (with ``--calls``) from the scheduler's start to the pods'
        deletion."""
        args = self.args
        asks = [GpuAsk(f"{run}-{i:04d}", 1, SHARES_GIB[i % len(SHARES_GIB)]) for i in range(args.pods)]
        list(self.pool.map(lambda ask: self.create(setup, run, ask), asks))
        bound = BindTimes()
        watch = WatchCache(self.cluster.api, "pods", label_selector=f"{RUN_LABEL}={run}")
        watch.add_listener(bound)
        watch.start()
        process: Process | None = None
        try:
            watch.wait_synced(60)
            process, url = self.start_extender(setup, run)
            ours = Extender(process, url, args.profile) if setup == GPUSHARE and process and url else None
            offset = self.cluster.audit_log.stat().st_size if args.calls else 0
            verbs_before = ours.verb_seconds() if ours else {}
            with ours.sampled(run) if ours else contextlib.nullcontext():
                cpu = self.schedule(run, self.scheduler_config(setup, url), bound, process)
            if ours:
                ours.report(verbs_before)
        finally:
            if process is not None:
                process.stop()
            watch.stop()
        print(
            f"  CPU ms per pod: {'; '.join(f'{name} {1000 * s / args.pods:.2f}' for name, s in cpu.items() if s)}",
            flush=True,
        )
        calls = audited_calls(self.cluster.audit_log, offset) if args.calls else Counter()
        if setup in PLACED_BY:
            pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"{RUN_LABEL}={run}").items
            placed = [p for p in pods if PLACED_BY[setup] in (p.metadata.annotations or {})]
            if len(placed) != args.pods:
                raise ClusterError(f"run {run}: only {len(placed)} of {args.pods} pods carry {PLACED_BY[setup]}")
        self.clean(setup, run)
        return Run(bound.rate(), 1000 * sum(cpu.values()) / args.pods, calls)

    def schedule(self, run: str, config: str, bound: BindTimes, extender: Process | None) -> dict[str, float]:
        """kube-scheduler with ``config`` until every pod of ``run`` is bound; the CPU seconds each process
        spent meanwhile."""
        args = self.args
        open_paths = ("/debug/pprof/profile",) if args.pprof else ()
        scheduler, port = start_scheduler(self.cluster, run, config, open_paths)
        try:
            profiles = []
            if args.pprof:
                wait_for(
                    lambda: scheduler.check() or http_status(f"https://127.0.0.1:{port}/healthz") == 200,
                    30,
                    "kube-scheduler",
                )
                for who, url, token in (("apiserver", self.cluster.server, self.cluster.admin.token),
                                        ("scheduler", f"https://127.0.0.1:{port}", "")):  # fmt: skip
                    out = args.pprof / f"{run}-{who}.pprof"
                    profiles.append(self.pool.submit(pprof_cpu, url, token, out, args.pprof_seconds))
            measured = {p.name: p.pid for p in self.cluster.processes if p.alive} | {"kube-scheduler": scheduler.pid}
            if extender is not None:
                measured["extender"] = extender.pid
            before = {name: cpu_seconds(pid) for name, pid in measured.items()}
            wait_for(
                lambda: scheduler.check() or bound.count() == args.pods,
                BIND_TIMEOUT,
                f"{args.pods} bindings in run {run} ({bound.count()} seen; log {scheduler.log_path})",
                0.2,
            )
            cpu = {name: cpu_seconds(pid) - before[name] for name, pid in measured.items()}
            for profile in profiles:  # before kube-scheduler stops: it serves its own profile
                profile.result()
            return cpu
        finally:
            scheduler.stop()

    def clean(self, setup: str, run: str) -> None:
        """The run's pods gone, then its claims (kube-controller-manager releases a claim once its pod is)."""
        delete_run_pods(self.core, run)
        if setup == DRA:
            delete_run_claims(self.resource, run)

    def measure(self, size: int) -> str:
        """Every setup ``--rounds`` times, the order reversing each round; the table of medians."""
        args = self.args
        setups = self.setups()
        runs: dict[str, list[Run]] = {setup: [] for setup in setups}
        for round_ in range(args.rounds):
            for setup in setups if round_ % 2 == 0 else setups[::-1]:
                run = f"n{size}-r{round_}-{setup.lower()}"
                result = self.run(setup, run)
                runs[setup].append(result)
                print(
                    f"{size} nodes, round {round_ + 1}: {LABELS[setup]}: {result.rate:.1f} pods/s, "
                    f"{result.cpu_ms:.1f} CPU ms per pod",
                    flush=True,
                )
                if setup == GPUSHARE and args.profile:
                    print(top(args.profile / f"{run}.txt"), flush=True)
        if args.calls:
            report_calls({setup: sum((r.calls for r in rs), Counter()) for setup, rs in runs.items()}, args)
        return table(runs, f"{size} nodes x {args.gpus}, {args.pods} pods, {args.rounds} round(s), medians:")


def report_calls(calls: dict[str, Counter[str]], args: argparse.Namespace) -> None:
    pods = args.pods * args.rounds
    print("API requests per pod bound (kube-apiserver's audit log, all rounds):")
    for setup, counted in calls.items():
        print(f"  {LABELS[setup]}: {sum(counted.values()) / pods:.2f}")
        for key, n in sorted(counted.items(), key=lambda kv: -kv[1]):
            print(f"    {n / pods:6.2f}  {key}")


def table(runs: dict[str, list[Run]], title: str) -> str:
    """setup | pods/s | of plain | CPU ms per pod, each the median of the setup's rounds."""
    rate = {setup: statistics.median(r.rate for r in rs) for setup, rs in runs.items()}
    lines = [title, "| setup | pods/s | of plain | CPU ms per pod, all processes |", "|---|---:|---:|---:|"]
    for setup, rs in runs.items():
        cpu = statistics.median(r.cpu_ms for r in rs)
        lines.append(f"| {LABELS[setup]} | {rate[setup]:.1f} | {100 * rate[setup] / rate[PLAIN]:.0f}% | {cpu:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1000,5000", help="cluster sizes measured in turn, comma-separated")
    parser.add_argument("--pods", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpus", default="4xA100-80GB:81920", help="every node's cards, as --gpus sim:... takes them")
    parser.add_argument(
        "--qps",
        type=float,
        default=1000.0,
        help="client qps and burst of kube-scheduler and Alibaba's extender (ours has no client limit)",
    )
    parser.add_argument(
        "--aliyun-src",
        type=Path,
        help="a checkout of github.com/AliyunContainerService/gpushare-scheduler-extender to build and measure",
    )
    parser.add_argument("--calls", action="store_true", help="count API requests per pod from an audit log")
    parser.add_argument("--profile", type=Path, help="sample the gpushare extender with py-spy into this directory")
    parser.add_argument("--policy", default="", help="the gpushare extender's placement policy (its default if empty)")
    parser.add_argument("--pprof", type=Path, help="write Go CPU profiles of each run here")
    parser.add_argument("--pprof-seconds", type=int, default=8, help="how long each profile samples from the start")
    parser.add_argument("--pin", action="store_true", help="the extender on a CPU of its own (needs 2 CPUs)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs) afterwards")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    if args.pods < 2 or args.rounds < 1:
        parser.error("need at least 2 pods (a rate is between bindings) and 1 round")
    for directory in (args.profile, args.pprof):
        if directory:
            directory.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING)
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin needs two CPUs")
        os.sched_setaffinity(0, cpus[:1])  # every process started from here on inherits it
        args.extender_cpu = cpus[1]
    with tempfile.TemporaryDirectory(prefix="gs-aliyun-build-") as build_dir:
        binary = None
        if args.aliyun_src is None:
            print("Alibaba's extender: skipped (--aliyun-src DIR names a checkout of its source)", flush=True)
        else:
            try:
                binary = aliyun.build(args.aliyun_src, Path(build_dir), args.qps)
            except ClusterError as exc:
                parser.error(str(exc))
        tables = measure_sizes(args, sizes, binary)
    pinned = "; control plane on one CPU, the extender on another" if args.pin else ""
    print(f"\nKubernetes {KUBE_VERSION}, client qps/burst {args.qps:g} everywhere{pinned}", *tables, sep="\n")
    return 0


def measure_sizes(args: argparse.Namespace, sizes: Sequence[int], aliyun_binary: Path | None) -> list[str]:
    """One cluster, grown to each size in turn; each size's table."""
    tables = []
    with real_cluster(
        "gs-tput-", (), args.keep, scheduler_names=(), controllers=("*", "-node-lifecycle-controller"),
        audited_users=CALLERS if args.calls else (),
    ) as cluster, ThreadPoolExecutor(8) as pool:  # fmt: skip
        utils.create_from_yaml(cluster.api, str(DEVICE_CLASS))
        bench = Bench(cluster, pool, args, aliyun_binary)
        created = 0
        for size in sizes:
            started = time.monotonic()
            bench.grow([(f"node-{i:05d}", args.gpus) for i in range(created, size)])
            created = size
            print(f"{size} nodes ({args.gpus}) in {time.monotonic() - started:.0f}s", flush=True)
            tables.append(bench.measure(size))
            print(tables[-1], flush=True)
    return tables


if __name__ == "__main__":
    sys.exit(main())
