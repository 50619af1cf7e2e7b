"""Replay Alibaba's openb GPU-sharing trace the way the FGD paper does, with our placement policies.

Reference: Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation
Gradient Descent", USENIX ATC'23. The replay rules are in /work/shared/traces/openb/README.md: pods
arrive one at a time (sorted by name, shuffled per seed, topped up with clones to 130% of capacity),
nobody leaves, a pod that fits nowhere is dropped, and the metric is the average allocation per
integer arrived-% bucket, median over seeds.

Node costs come from ``gpushare.placement`` (the extender's policies, vectorised over nodes); the
replay adds what the extender can't see: CPU, memory and model filtering, the CPU half of the
BestFit formula, and CPU in FGD's "could this typical pod fit here at all".

    python benchmarks/trace_replay.py --trace default --seeds 42-51 --policies binpack,spread,fgd,random
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from openb import MILLI_PER_CARD, NODE_FILE, TRACE_DIR, TraceNode, TracePod, load_nodes, load_pods, pod_file

from gpushare.placement import POLICIES, Fgd, HostFit, Policy, Shape, Workload, batch_place
from gpushare.placement.fragmentation import most_common

LOAD = 1.3
#: FGD's typical pods: the most common shapes covering this share of pods, taken TYPICAL_STEP at a
#: time (the paper's simulator grows the list ten shapes at a time, which on ``default`` brings in
#: an 8-GPU shape)
TYPICAL_COVERAGE = 0.95
TYPICAL_STEP = 10
ARRIVALS = (90, 100, 130)
#: the paper's policy our policy corresponds to, for the side-by-side table
PAPER_POLICY = {"binpack": "05-BestFit", "fgd": "06-FGD", "random": "01-Random"}
#: BestFit's normalisers: the largest node's CPU (milli) and GPU (milli) in the paper's cluster
BESTFIT_CPU_SCALE = 128_000
BESTFIT_GPU_SCALE = 8_000
REPLAY_POLICIES = (*POLICIES, "random")


def gpu_shape(num_gpu: int, gpu_milli: int) -> Shape:
    """A trace request as a placement demand: whole cards when it asks for full cards, else shares."""
    if num_gpu == 0:
        return Shape(0, 0)
    if gpu_milli >= MILLI_PER_CARD:
        return Shape(0, num_gpu, exclusive=True)
    return Shape(gpu_milli, num_gpu)


def arrival_order(pods: Sequence[TracePod], seed: int, capacity_milli: int) -> list[TracePod]:
    """Originals sorted by name and shuffled, then clones drawn with replacement up to LOAD x capacity."""
    rng = random.Random(seed)
    originals = sorted(pods, key=lambda p: p.name)
    order = list(originals)
    rng.shuffle(order)
    target = LOAD * capacity_milli
    requested = sum(p.gpu_request for p in order)
    while True:
        clone = originals[rng.randrange(len(originals))]
        if requested + clone.gpu_request > target:
            return order
        order.append(clone)
        requested += clone.gpu_request


@dataclass(frozen=True, slots=True)
class Cluster:
    """The trace's GPU nodes as arrays: (nodes, cards) capacity in milli, per-node CPU, memory, model."""

    capacity: np.ndarray
    cpu: np.ndarray
    memory: np.ndarray
    model: np.ndarray

    @classmethod
    def of(cls, nodes: Sequence[TraceNode]) -> Cluster:
        width = max(n.gpus for n in nodes)
        capacity = np.array([[MILLI_PER_CARD] * n.gpus + [0] * (width - n.gpus) for n in nodes], dtype=np.int64)
        return cls(
            capacity,
            np.array([n.cpu_milli for n in nodes], dtype=np.int64),
            np.array([n.memory_mib for n in nodes], dtype=np.int64),
            np.array([n.model for n in nodes]),
        )

    @property
    def total_milli(self) -> int:
        return int(self.capacity.sum())

    def allows(self, models: frozenset[str]) -> np.ndarray:
        return np.ones(len(self.cpu), dtype=bool) if not models else np.isin(self.model, sorted(models))


@dataclass(frozen=True, slots=True)
class TypicalPods:
    """FGD's workload: the pod shapes covering 95% of the trace, with what each needs besides GPUs."""

    workload: Workload
    cpu: np.ndarray
    allowed: np.ndarray  # (nodes, shapes): the node's model suits the shape

    @classmethod
    def of(cls, pods: Sequence[TracePod], cluster: Cluster) -> TypicalPods:
        shapes = [(p.cpu_milli, p.gpu_milli, p.num_gpu, tuple(sorted(p.models))) for p in pods]
        kept = most_common(shapes, TYPICAL_COVERAGE, TYPICAL_STEP)
        shapes = [gpu_shape(n, milli) for (_, milli, n, _), _ in kept]
        allowed = np.stack([cluster.allows(frozenset(m)) for (_, _, _, m), _ in kept], axis=1)
        return cls(
            Workload(tuple(shapes), tuple(c for _, c in kept)),
            np.array([cpu for (cpu, _, _, _), _ in kept], dtype=np.int64),
            allowed,
        )

    @property
    def policy(self) -> Policy:
        return Fgd(self.workload)

    def host_fit(self, rows: np.ndarray, cpu_free: np.ndarray, cpu_taken: int) -> HostFit:
        allowed = self.allowed[rows]
        return HostFit(
            allowed & (cpu_free[:, None] >= self.cpu), allowed & ((cpu_free - cpu_taken)[:, None] >= self.cpu)
        )


def replay(
    cluster: Cluster, order: Sequence[TracePod], policy: str, typical: TypicalPods, seed: int
) -> dict[int, float]:
    """Average allocation % per integer arrived-% bucket for one policy and one arrival order."""
    rng = np.random.default_rng(seed)
    free = cluster.capacity.copy()
    cpu = cluster.cpu.copy()
    memory = cluster.memory.copy()
    total = cluster.total_milli
    allows: dict[frozenset[str], np.ndarray] = {}
    requested = allocated = 0
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for pod in order:
        requested += pod.gpu_request
        if pod.models not in allows:
            allows[pod.models] = cluster.allows(pod.models)
        rows = np.flatnonzero((cpu >= pod.cpu_milli) & (memory >= pod.memory_mib) & allows[pod.models])
        picked = _pick(cluster, free, cpu, rows, pod, policy, typical, rng) if rows.size else None
        if picked is not None:
            node, cards = picked
            shape = gpu_shape(pod.num_gpu, pod.gpu_milli)
            free[node, cards] -= cluster.capacity[node, cards] if shape.exclusive else shape.units
            cpu[node] -= pod.cpu_milli
            memory[node] -= pod.memory_mib
            allocated += pod.gpu_request
        bucket = int(np.floor(100 * requested / total + 0.5))
        sums[bucket] = sums.get(bucket, 0.0) + 100 * allocated / total
        counts[bucket] = counts.get(bucket, 0) + 1
    return {b: sums[b] / counts[b] for b in sums}


def _pick(
    cluster: Cluster,
    free: np.ndarray,
    cpu: np.ndarray,
    rows: np.ndarray,
    pod: TracePod,
    policy: str,
    typical: TypicalPods,
    rng: np.random.Generator,
) -> tuple[int, np.ndarray] | None:
    """The node (row) and card positions the policy picks among ``rows``, or None if the pod fits nowhere."""
    shape = gpu_shape(pod.num_gpu, pod.gpu_milli)
    capacity = cluster.capacity[rows]
    sub_free = free[rows]
    if policy == "random":
        able = (capacity > 0) & (sub_free >= (capacity if shape.exclusive else shape.units))
        fitting = np.flatnonzero(able.sum(axis=1) >= shape.cards)
        if not fitting.size:
            return None
        row = int(rng.choice(fitting))
        cards = rng.choice(np.flatnonzero(able[row]), size=shape.cards, replace=False)
        return int(rows[row]), cards
    host = typical.host_fit(rows, cpu[rows], pod.cpu_milli) if policy == "fgd" else None
    choice = batch_place(typical.policy if policy == "fgd" else POLICIES[policy], capacity, sub_free, shape, host)
    cost = choice.cost
    if policy == "binpack":
        cpu_left = (cpu[rows] - pod.cpu_milli) / BESTFIT_CPU_SCALE
        cost = 0.5 * cpu_left + 0.5 * cost / BESTFIT_GPU_SCALE
    best = cost.min()
    if not np.isfinite(best):
        return None
    row = int(rng.choice(np.flatnonzero(cost == best)))
    return int(rows[row]), choice.cards[row]


@dataclass(frozen=True, slots=True)
class Job:
    trace_dir: Path
    trace: str
    policy: str
    seed: int


def run_job(job: Job) -> tuple[str, int, dict[int, float]]:
    nodes = load_nodes(job.trace_dir / NODE_FILE)
    pods = load_pods(job.trace_dir / pod_file(job.trace))
    cluster = Cluster.of(nodes)
    order = arrival_order(pods, job.seed, cluster.total_milli)
    return job.policy, job.seed, replay(cluster, order, job.policy, TypicalPods.of(pods, cluster), job.seed)


def medians(results: Sequence[tuple[str, int, dict[int, float]]]) -> dict[str, dict[int, float]]:
    """Per policy and reported arrival: the median over seeds of the bucket's average allocation %."""
    table: dict[str, dict[int, float]] = {}
    for policy in dict.fromkeys(r[0] for r in results):
        runs = [buckets for p, _, buckets in results if p == policy]
        table[policy] = {
            a: statistics.median(b[a] for b in runs) if all(a in b for b in runs) else float("nan") for a in ARRIVALS
        }
    return table


def paper_medians(trace_dir: Path, trace: str) -> dict[str, dict[int, float]]:
    path = trace_dir / "paper_alloc_medians.csv"
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        return {
            row["policy"]: {a: float(row[f"alloc{a}"]) for a in ARRIVALS}
            for row in csv.DictReader(f)
            if row["workload"] == pod_file(trace).removesuffix(".csv")
        }


def format_table(ours: dict[str, dict[int, float]], paper: dict[str, dict[int, float]]) -> str:
    head = (
        " | ".join(f"ours {a}%" for a in ARRIVALS) + " | paper policy | " + " | ".join(f"paper {a}%" for a in ARRIVALS)
    )
    lines = [f"| policy | {head} |", "|" + "---|" * (2 + 2 * len(ARRIVALS))]
    for policy, row in ours.items():
        name = PAPER_POLICY.get(policy, "")
        theirs = paper.get(name)
        cells = [f"{row[a]:.2f}" for a in ARRIVALS] + [name or "-"]
        cells += [f"{theirs[a]:.2f}" if theirs else "-" for a in ARRIVALS]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    for name, theirs in paper.items():
        if name not in PAPER_POLICY.values():
            cells = ["-"] * len(ARRIVALS) + [name] + [f"{theirs[a]:.2f}" for a in ARRIVALS]
            lines.append("| - | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="default", help="pod list variant: default, gpushare40, cpu250, ...")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42-51"))
    parser.add_argument("--policies", default=",".join(REPLAY_POLICIES))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = sorted(set(policies) - set(REPLAY_POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {list(REPLAY_POLICIES)}")
    jobs = [Job(args.trace_dir, args.trace, p, s) for p in policies for s in args.seeds]
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(run_job, jobs))
    print(
        f"trace {args.trace}, seeds {args.seeds[0]}..{args.seeds[-1]} ({len(args.seeds)}), "
        f"{time.monotonic() - started:.0f} s with {args.workers} workers"
    )
    print(format_table(medians(results), paper_medians(args.trace_dir, args.trace)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
