"""Filter calls per waiting GPU pod per minute, on the real kube-scheduler, while the nodes change.

    python benchmarks/waiting_pods.py [--nodes 100] [--pods 100] [--every 10] [--change annotation]
                                      [--gpus 4xA100-40GB:40960] [--ask 60] [--warmup 30] [--window 60]
                                      [--rounds 3]

Root and the built Kubernetes binaries are needed (see the README). No kubelets run: the nodes are Node
objects as in benchmarks/scheduler_throughput.py, and the extender runs as its own process on loopback
for the whole run. ``--pods`` pods each ask ``--ask`` GiB of one card, more than any card of
``--gpus`` holds but less than a node's total, so kube-scheduler's own plugins pass every node and the
extender refuses every one: the pods wait. Meanwhile each node changes every ``--every`` seconds, the
nodes in turn: ``annotation`` changes an annotation (as the extender's ledger of binds on a node does on
every bind there, and node labelers do), ``heartbeat`` patches only the Ready condition's heartbeat
time (what kubelet's status report changes when nothing else did).

Each round measures both setups, the order alternating from round to round: the pods are created, then
kube-scheduler starts with the sandbox's configuration and either kube-scheduler's default feature gates
("before") or those docs/operations.md has operators set ("after": SchedulerPopFromBackoffQ off, so
kube-scheduler's back-off spaces the retries of a refused pod out), and after ``--warmup`` seconds (the
back-off has grown to its maximum by then) the extender's own count of filter calls
(``gpushare_extender_verb_seconds_count{verb="filter"}``) is read before and after ``--window`` seconds.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

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
from prometheus_client.parser import text_string_to_metric_families
from realbench import real_cluster

from gpushare.contract.names import RESOURCE_MEM
from gpushare.sandbox.binaries import KUBE_VERSION
from gpushare.sandbox.controlplane import SCHEDULER_FEATURE_GATES
from gpushare.sandbox.launch import ClusterError, wait_for
from gpushare.sandbox.realcluster import RealCluster

#: each setup's kube-scheduler feature gates
SETUPS = {"before": (), "after": SCHEDULER_FEATURE_GATES}
CHANGES = ("annotation", "heartbeat")
#: the annotation ``--change annotation`` rewrites
TICK_ANNOTATION = "bench.gpushare.io/tick"


def filter_calls(url: str) -> float:
    """How many filter calls the extender has answered so far, from its /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "gpushare_extender_verb_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count") and sample.labels.get("verb") == "filter":
                    return sample.value
    return 0.0


class Churn:
    """Changes each of ``nodes`` every ``every`` seconds, one node at a time, spread evenly over the period,
    until stopped; counts the changes made."""

    def __init__(self, core: client.CoreV1Api, nodes: Sequence[str], every: float, change: str) -> None:
        self.core, self.nodes, self.every, self.change = core, nodes, every, change
        self.made = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        step = self.every / len(self.nodes)
        due = time.monotonic()
        for tick, node in zip(itertools.count(), itertools.cycle(self.nodes)):
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            due += step
            if self.change == "annotation":
                self.core.patch_node(node, {"metadata": {"annotations": {TICK_ANNOTATION: str(tick)}}})
            else:
                now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                beat = {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now}
                self.core.patch_node_status(node, {"status": {"conditions": [beat]}})
            self.made += 1


def run_once(
    cluster: RealCluster, core: client.CoreV1Api, pool: ThreadPoolExecutor, args: argparse.Namespace, run: str,
    url: str, feature_gates: Sequence[str],
) -> float:  # fmt: skip
    """Create the pods, start kube-scheduler with ``feature_gates``, count the filter calls over the
    window; filter calls per pod per minute."""
    limits = {RESOURCE_MEM: str(args.ask)}
    bodies = [pod_body(f"{run}-{i:04d}", run, limits) for i in range(args.pods)]
    list(pool.map(lambda body: core.create_namespaced_pod(NAMESPACE, body), bodies))
    start = filter_calls(url)
    scheduler, _ = start_scheduler(cluster, run, scheduler_config(cluster, url, 1000.0), feature_gates=feature_gates)
    try:
        wait_for(
            lambda: scheduler.check() or filter_calls(url) - start >= args.pods,
            120,
            f"every pod of run {run} sent to the extender once (log {scheduler.log_path})",
            0.5,
        )
        time.sleep(args.warmup)  # the back-off grows with each refusal: measure once it has
        before = filter_calls(url)
        time.sleep(args.window)
        scheduler.check()
        calls = filter_calls(url) - before
    finally:
        scheduler.stop()
    bound = [p for p in core.list_namespaced_pod(NAMESPACE, label_selector=f"{RUN_LABEL}={run}").items
             if p.spec.node_name]  # fmt: skip
    if bound:
        raise ClusterError(f"run {run}: {len(bound)} pod(s) were placed although no card can hold them")
    delete_run_pods(core, run)
    return calls / args.pods / (args.window / 60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between two changes of a node")
    parser.add_argument("--change", choices=CHANGES, default="annotation", help="what changes on a node")
    parser.add_argument("--gpus", default="4xA100-40GB:40960", help="every node's cards, as --gpus sim:... takes them")
    parser.add_argument("--ask", type=int, default=60, help="GiB of one card each pod asks for")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds from the first refusals to the window")
    parser.add_argument("--window", type=float, default=60.0, help="seconds the filter calls are counted over")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs) afterwards")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rates: dict[str, list[float]] = {setup: [] for setup in SETUPS}
    with real_cluster(
        "gs-wait-", (), args.keep, scheduler_names=(), controllers=("*", "-node-lifecycle-controller")
    ) as cluster:  # fmt: skip
        core = client.CoreV1Api(cluster.api)
        with ThreadPoolExecutor(8) as pool:
            names = [f"node-{i:05d}" for i in range(args.nodes)]
            create_nodes(core, pool, [(name, args.gpus) for name in names])
            process, url = start_extender(cluster, "extender")
            churn = Churn(core, names, args.every, args.change)
            churn.start()
            try:
                for round_ in range(args.rounds):
                    order = list(SETUPS) if round_ % 2 == 0 else list(SETUPS)[::-1]
                    for setup in order:
                        rate = run_once(cluster, core, pool, args, f"r{round_}-{setup}", url, SETUPS[setup])
                        rates[setup].append(rate)
                        print(f"round {round_ + 1}: {setup}: {rate:.1f} filter calls per pod per minute", flush=True)
            finally:
                churn.stop()
                process.stop()
    before, after = (statistics.median(rates[s]) for s in SETUPS)
    gates = ",".join(SCHEDULER_FEATURE_GATES)
    print(
        f"\nKubernetes {KUBE_VERSION}; {args.pods} pods of {args.ask} GiB waiting, {args.nodes} nodes "
        f"({args.gpus}), each node's {args.change} changing every {args.every:g} s; "
        f"{args.rounds} rounds, {args.window:g} s windows after {args.warmup:g} s (medians):\n"
        f"  before (default feature gates): {before:.1f} filter calls per pod per minute\n"
        f"  after (--feature-gates={gates}): {after:.1f} filter calls per pod per minute"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
