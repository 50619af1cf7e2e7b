"""Pods bound per second by the real kube-scheduler, alone and with the gpushare extender.

    python benchmarks/scheduler_throughput.py [--nodes 1000,5000] [--pods 800] [--rounds 3] [--qps 1000]
                                              [--gpus 4xA100-80GB:81920] [--calls] [--profile DIR]

Root and the built Kubernetes binaries are needed (see the README). One etcd and kube-apiserver serve
every round; no kubelets run: the nodes are Node objects carrying the advertiser's inventory annotation
and, in their status, what kubelet and the device plugin would report (cpu, memory, pods,
``aliyun.com/gpu-mem`` in units, ``aliyun.com/gpu-count`` as one replica per unit of each card). The
extender runs as its own process on loopback (plain HTTP) for the whole run, watching the cluster.

Each round measures both setups, the order alternating from round to round: the pods are created
first, then kube-scheduler starts (with ``deploy/scheduler-config.yaml``'s extender block, or with no
extender), and the rate is the pods bound after the first one over the time from the first binding
to the last, as a watch in this script sees them. The scheduler is then stopped and the pods deleted.
Both setups give kube-scheduler the same client rate limit (``clientConnection.qps`` and ``burst``,
``--qps``): at its default of 50 requests/s the plain scheduler's own binding calls are what limits it.
kube-controller-manager runs without its node lifecycle controller: no kubelet heartbeats these nodes, so
it would otherwise mark them unreachable mid-run.

``--nodes`` takes several sizes: the cluster grows to each in turn and both setups are measured there.
``--calls`` has kube-apiserver audit kube-scheduler's and the extender's requests and reports them per pod
bound (auditing costs the API server a little, so the rates of such a run are not the headline figures).
``--profile DIR`` samples the extender with py-spy during its runs and prints the top of each profile;
``--pprof DIR`` writes kube-apiserver's and kube-scheduler's CPU profiles of each run (``go tool pprof
-top FILE``).
``--pin`` runs the control plane (and this script) on the first CPU and the extender on the second, as
when the extender runs as a Deployment of its own: its CPU then doesn't compete with kube-scheduler's
and kube-apiserver's, and the ratio shows what it costs them and the scheduling cycle. Without it,
everything shares every CPU, and on a small machine the ratio is mostly the CPU each setup needs per
pod (printed per process after each run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client
from nodeless import (
    NAMESPACE,
    RUN_LABEL,
    create_nodes,
    delete_run_pods,
    pod_body,
    scheduler_config,
    start_extender,
    start_scheduler,
)
from profiling import sampled, top
from prometheus_client.parser import text_string_to_metric_families
from realbench import real_cluster

from gpushare.contract.names import ANN_ALLOCATION, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.kube.watch import WatchCache
from gpushare.sandbox.binaries import KUBE_VERSION
from gpushare.sandbox.launch import ClusterError, Process, http_status, loopback_get, wait_for
from gpushare.sandbox.realcluster import RealCluster

#: (gpu-mem, gpu-count) the pods ask for, in turn: mostly shared cards, a few two-card pods
SHAPES = ((1, 0), (2, 0), (4, 0), (8, 0), (2, 0), (16, 0), (8, 2), (4, 0))
BIND_TIMEOUT = 600.0
SETUPS = ("scheduler alone", "with extender")
#: whose requests --calls counts: what binding a pod costs the API server in each setup
CALLERS = ("system:kube-scheduler", "gpushare-extender")


def shape_limits(shape: tuple[int, int]) -> dict[str, str]:
    mem, count = shape
    return {name: str(n) for name, n in ((RESOURCE_MEM, mem), (RESOURCE_COUNT, count)) if n}


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
    """The extender process, and where its profiles go (None: not profiled)."""

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


def run_once(
    cluster: RealCluster, core: client.CoreV1Api, pool: ThreadPoolExecutor, args: argparse.Namespace, run: str,
    extender: Extender | None,
) -> tuple[float, Counter[str]]:  # fmt: skip
    """Create the pods, start kube-scheduler, wait for every binding; pods bound per second, and the
    audited requests (with ``--calls``) from the scheduler's start to the pods' deletion."""
    names = [f"{run}-{i:04d}" for i in range(args.pods)]
    bodies = [pod_body(names[i], run, shape_limits(SHAPES[i % len(SHAPES)])) for i in range(args.pods)]
    list(pool.map(lambda body: core.create_namespaced_pod(NAMESPACE, body), bodies))
    bound = BindTimes()
    watch = WatchCache(cluster.api, "pods", label_selector=f"{RUN_LABEL}={run}")
    watch.add_listener(bound)
    watch.start()
    watch.wait_synced(60)
    offset = cluster.audit_log.stat().st_size if args.calls else 0
    verbs_before = extender.verb_seconds() if extender else {}
    with extender.sampled(run) if extender else contextlib.nullcontext():
        open_paths = ("/debug/pprof/profile",) if args.pprof else ()
        config = scheduler_config(cluster, extender.url if extender else None, args.qps)
        scheduler, port = start_scheduler(cluster, run, config, open_paths)
        profiles = []
        if args.pprof:
            wait_for(
                lambda: scheduler.check() or http_status(f"https://127.0.0.1:{port}/healthz") == 200,
                30,
                "kube-scheduler",
            )
            for who, url, token in (("apiserver", cluster.server, cluster.admin.token),
                                    ("scheduler", f"https://127.0.0.1:{port}", "")):  # fmt: skip
                out = args.pprof / f"{run}-{who}.pprof"
                profiles.append(pool.submit(pprof_cpu, url, token, out, args.pprof_seconds))
        measured = {p.name: p.pid for p in cluster.processes if p.alive} | {"kube-scheduler": scheduler.pid}
        if extender is not None:
            measured["extender"] = extender.process.pid
        cpu_before = {name: cpu_seconds(pid) for name, pid in measured.items()}
        try:
            wait_for(
                lambda: scheduler.check() or bound.count() == args.pods,
                BIND_TIMEOUT,
                f"{args.pods} bindings in run {run} ({bound.count()} seen; log {scheduler.log_path})",
                0.2,
            )
            cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in measured.items()}
            for profile in profiles:  # before kube-scheduler stops: it serves its own profile
                profile.result()
        finally:
            scheduler.stop()
            watch.stop()
    print(
        f"  CPU ms per pod: {'; '.join(f'{name} {1000 * s / args.pods:.2f}' for name, s in cpu.items() if s)}",
        flush=True,
    )
    calls = audited_calls(cluster.audit_log, offset) if args.calls else Counter()
    if extender is not None:
        spent = []
        for verb, (count, seconds) in sorted(extender.verb_seconds().items()):
            count0, seconds0 = verbs_before.get(verb, (0.0, 0.0))
            if count > count0:
                spent.append(f"{verb} {1000 * (seconds - seconds0) / (count - count0):.2f} ms x{count - count0:.0f}")
        print(f"  extender, mean time per call: {'; '.join(spent)}", flush=True)
        placed = [p for p in core.list_namespaced_pod(NAMESPACE, label_selector=f"{RUN_LABEL}={run}").items
                  if ANN_ALLOCATION in (p.metadata.annotations or {})]  # fmt: skip
        if len(placed) != args.pods:
            raise ClusterError(f"run {run}: only {len(placed)} of {args.pods} pods carry the extender's allocation")
    delete_run_pods(core, run)
    return bound.rate(), calls


def report_calls(calls: dict[str, Counter[str]], pods: int) -> None:
    print("API requests per pod bound (kube-apiserver's audit log, all rounds):")
    for setup in SETUPS:
        total = sum(calls[setup].values())
        print(f"  {setup}: {total / pods:.2f}")
        for key, n in sorted(calls[setup].items(), key=lambda kv: -kv[1]):
            print(f"    {n / pods:6.2f}  {key}")


def measure(
    cluster: RealCluster, core: client.CoreV1Api, pool: ThreadPoolExecutor, args: argparse.Namespace, size: int
) -> str:
    """Both setups, ``--rounds`` times, with an extender started on the cluster as it now is (as one
    deployed on a running cluster starts); the medians."""
    pinned = ["taskset", "--cpu-list", str(args.extender_cpu)] if args.pin else []
    process, url = start_extender(cluster, f"extender-{size}", args.policy, pinned)
    extender = Extender(process, url, args.profile)
    rates: dict[str, list[float]] = {setup: [] for setup in SETUPS}
    calls: dict[str, Counter[str]] = {setup: Counter() for setup in SETUPS}
    try:
        for round_ in range(args.rounds):
            order = SETUPS if round_ % 2 == 0 else SETUPS[::-1]
            for setup in order:
                via = extender if setup == SETUPS[1] else None
                run = f"n{size}-r{round_}-{'ext' if via else 'plain'}"
                rate, counted = run_once(cluster, core, pool, args, run, via)
                rates[setup].append(rate)
                calls[setup] += counted
                print(f"{size} nodes, round {round_ + 1}: {setup}: {rate:.1f} pods/s", flush=True)
                if via and args.profile:
                    print(top(args.profile / f"{run}.txt"), flush=True)
    finally:
        process.stop()
    if args.calls:
        report_calls(calls, args.pods * args.rounds)
    alone, ext = (statistics.median(rates[s]) for s in SETUPS)
    return (
        f"{size} nodes, {args.pods} pods, {args.rounds} rounds (medians): scheduler alone "
        f"{alone:.1f} pods/s, with extender {ext:.1f} pods/s: {100 * ext / alone:.0f}%"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000,5000", help="cluster sizes measured in turn, comma-separated")
    parser.add_argument("--pods", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpus", default="4xA100-80GB:81920", help="every node's cards, as --gpus sim:... takes them")
    parser.add_argument(
        "--qps", type=float, default=1000.0, help="kube-scheduler's client qps and burst, in both setups"
    )
    parser.add_argument("--calls", action="store_true", help="count API requests per pod from an audit log")
    parser.add_argument("--profile", type=Path, help="sample the extender with py-spy into this directory")
    parser.add_argument("--policy", default="", help="the extender's placement policy (its default if empty)")
    parser.add_argument("--pprof", type=Path, help="write Go CPU profiles of each run here")
    parser.add_argument("--pprof-seconds", type=int, default=8, help="how long each profile samples from the start")
    parser.add_argument("--pin", action="store_true", help="the extender on a CPU of its own (needs 2 CPUs)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs) afterwards")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
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
    summary = []
    with real_cluster(
        "gs-tput-", (), args.keep, scheduler_names=(), controllers=("*", "-node-lifecycle-controller"),
        audited_users=CALLERS if args.calls else (),
    ) as cluster:  # fmt: skip
        core = client.CoreV1Api(cluster.api)
        with ThreadPoolExecutor(8) as pool:
            created = 0
            for size in sizes:
                started = time.monotonic()
                create_nodes(core, pool, [(f"node-{i:05d}", args.gpus) for i in range(created, size)])
                created = size
                print(f"{size} nodes ({args.gpus}) in {time.monotonic() - started:.0f}s", flush=True)
                summary.append(measure(cluster, core, pool, args, size))
                print(summary[-1], flush=True)
    pinned = "; control plane on one CPU, the extender on another" if args.pin else ""
    print(f"\nKubernetes {KUBE_VERSION}, client qps/burst {args.qps:g} in both setups{pinned}", *summary, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
