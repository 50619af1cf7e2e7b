"""Where the real kube-scheduler places the same GPU pods through gpushare's extender, through DRA, through
DRA with each node's slice ordered for first fit, and through DRA with the extender's prioritize steering
the node.

    python benchmarks/dra_replay.py [--trace gpushare40] [--pods 300] [--seed 42] [--card-gib 32]
                                    [--nodes "12*8xV100-32GB:32768;8*8xA100-80GB:81920;4*4xT4-16GB:15360"]
                                    [--rounds 1] [--policy NAME] [--whole-cards smallest|largest|both]
                                    [--ways extender,DRA,DRA+order,DRA+prio] [--reorder-every 1] [--keep]

Root and the built Kubernetes binaries are needed (see the README). One etcd, kube-apiserver and
kube-controller-manager (without its node lifecycle controller) serve every run; no kubelets run. The
nodes (``--nodes``: ``COUNT*CARDS`` groups separated by ``;``, the cards as ``--gpus sim:...`` takes
them) are Node objects carrying the advertiser's inventory annotation and the device plugin's resources
in their status, and each also has the ResourceSlice its node agent publishes with ``--dra``
(``advertiser.resourceslice``); the DeviceClass is ``deploy/dra/deviceclass.yaml``.

The pods are the first ``--pods`` GPU pods of the openb trace ``--trace`` in the FGD paper's arrival
order for ``--seed``; a pod's share of a card becomes GiB of a ``--card-gib`` card, whole cards stay
whole cards (:mod:`gpushare.simulate.kubereplay` says how each way asks for them). Both ways get the same
pods in the same order, one at a time: a pod is created once kube-scheduler has bound the one before or
marked it Unschedulable, and nobody leaves, as in the paper's replay.

- **extender**: pods with ``aliyun.com/gpu-mem``/``gpu-count`` limits; kube-scheduler with
  ``deploy/scheduler-config.yaml``'s extenders; the extender (its default policy unless ``--policy``)
  started for the run. What each pod holds is read as every gpushare component reads it
  (:func:`gpushare.holdings.node.node_usage`).
- **DRA**: each pod with its own ResourceClaim; kube-scheduler without the extender. What each pod holds
  is its claim's ``status.allocation.devices.results`` (pool, device, ``consumedCapacity.memory``). A
  whole-card claim lists the card sizes smallest first (``--whole-cards largest``: largest first), and
  kube-scheduler prefers nodes where an earlier one fits: the only say a claim has in where it goes.
  With ``--whole-cards both`` every DRA way runs once with each order (columns ``<`` smallest first,
  ``>`` largest first).
- **DRA+order**: the same claims and kube-scheduler, but each node's slice lists its devices least free
  first (:func:`gpushare.advertiser.deviceorder.best_fit_order`), rewritten as the node agent does with
  ``--dra-order best-fit``: after each pod's decision (each ``--reorder-every``-th) every node whose
  order changed gets its slice replaced (the next pod is created once the writes are answered); the
  table counts those writes.
- **DRA+prio** (DRA + extender prioritize): the same claims; kube-scheduler with only
  ``deploy/scheduler-config.yaml``'s ``prioritize-host`` entry (no filter, no bind), pointing at the
  extender started for the run, which scores each node by how tightly the allocator's first fit there
  packs its cards (:mod:`gpushare.placement.dra`).

Each run ends with the pods (and claims) deleted; with ``--rounds`` the order of the ways rotates
from round to round and the table shows medians. Fragmentation is measured on the cards: free memory on
cards already partly used, and free memory on cards that can't take one card's worth of the median ask
left Pending (the pods left Pending by either way, pooled, so both are measured against the same ask).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import nodeless
from gpushare.advertiser.deviceorder import best_fit_order
from gpushare.advertiser.resourceslice import card_rooms, resource_slice
from kubernetes import client, utils
from kubernetes.client.rest import ApiException
from nodeless import NAMESPACE, RUN_LABEL
from realbench import real_cluster
from trace_replay import TRACE_DIR

from gpushare.cards import Card
from gpushare.contract.names import dra_slice_name
from gpushare.contract.resourceslice import live_generation
from gpushare.contract.units import GIB
from gpushare.gpus.backend import InventoryError
from gpushare.gpus.simulated import parse_sim_spec, simulated_cards
from gpushare.kube.objects import list_nodes, list_pods
from gpushare.kube.transport import call
from gpushare.kube.watch import WatchCache
from gpushare.placement import DEFAULT_POLICY
from gpushare.sandbox.binaries import KUBE_VERSION
from gpushare.sandbox.configfiles import REPO
from gpushare.sandbox.launch import ClusterError, Process
from gpushare.sandbox.realcluster import RealCluster
from gpushare.simulate.kubereplay import (
    GpuAsk,
    Outcome,
    ReplayError,
    arrivals,
    dra_claim_spec,
    dra_shares,
    extender_limits,
    extender_shares,
    median_ask,
    outcome,
)
from gpushare.simulate.trace import TraceError, load_pods

WAYS = ("extender", "DRA", "DRA+order", "DRA+prio")
#: the ways that place pods through ResourceClaims; the ways that run the extender
CLAIM_WAYS = ("DRA", "DRA+order", "DRA+prio")
EXTENDER_WAYS = ("extender", "DRA+prio")
#: the sign a DRA column carries for its whole-card claims' order
ORDER_SIGNS = {False: "<", True: ">"}
DEFAULT_NODES = "12*8xV100-32GB:32768;8*8xA100-80GB:81920;4*4xT4-16GB:15360"
DEVICE_CLASS = REPO / "deploy" / "dra" / "deviceclass.yaml"
#: how long one pod may wait for kube-scheduler's decision (binding, or Unschedulable)
DECISION_TIMEOUT = 120.0
#: kube-scheduler's client rate limit (qps and burst), in both ways
QPS = 1000.0


def parse_nodes(text: str) -> list[tuple[str, str]]:
    """``COUNT*CARDS;...`` as (node name, cards) pairs; ValueError naming the group at fault."""
    nodes: list[tuple[str, str]] = []
    for group in filter(None, (g.strip() for g in text.split(";"))):
        count, star, cards = group.partition("*")
        if not star or not count.isdigit() or int(count) < 1:
            raise ValueError(f"node group {group!r} is not COUNT*CARDS (e.g. 8*4xA100-80GB:81920)")
        try:
            parse_sim_spec(cards)
        except InventoryError as exc:
            raise ValueError(f"node group {group!r}: {exc}") from None
        nodes += [(f"node-{len(nodes) + i:03d}", cards) for i in range(int(count))]
    if not nodes:
        raise ValueError(f"no node groups in {text!r}")
    return nodes


class Decisions:
    """Per pod of one run, from a watch: bound, or marked Unschedulable by kube-scheduler."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.unschedulable: set[str] = set()
        #: pods bound after they had been found Unschedulable
        self.late: set[str] = set()
        self._changed = threading.Condition()

    def __call__(self, _kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        node = (pod.get("spec") or {}).get("nodeName")
        conditions = (pod.get("status") or {}).get("conditions") or []
        refused = any(
            c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
            for c in conditions
        )
        with self._changed:
            if node and name not in self.bound:
                self.bound.add(name)
                if name in self.unschedulable:
                    self.late.add(name)
            elif refused:
                self.unschedulable.add(name)
            self._changed.notify_all()

    def wait(self, name: str, timeout: float, check: Callable[[], None]) -> None:
        """Until ``name`` is bound or Unschedulable; ``check`` raises when the scheduler is gone."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while name not in self.bound and name not in self.unschedulable:
                check()
                if time.monotonic() > deadline:
                    raise ClusterError(f"pod {name}: no scheduling decision within {timeout:.0f}s")
                self._changed.wait(0.5)


@dataclass(frozen=True, slots=True)
class Column:
    """One way of placing the pods, with the order its whole-card claims list the card sizes in."""

    way: str
    largest_first: bool = False
    #: whether the column's label says the order (only when both orders are run)
    signed: bool = False

    @property
    def label(self) -> str:
        return f"{self.way}{ORDER_SIGNS[self.largest_first]}" if self.signed and self.claims else self.way

    @property
    def claims(self) -> bool:
        return self.way in CLAIM_WAYS


def columns(ways: Sequence[str], whole_cards: str) -> list[Column]:
    """The columns of ``ways`` (names of :data:`WAYS`), each DRA way once per whole-card order asked for."""
    orders = {"smallest": (False,), "largest": (True,), "both": (False, True)}[whole_cards]
    signed = len(orders) > 1
    return [
        Column(way, largest, signed)
        for way in ways
        for largest in (orders if way in CLAIM_WAYS else orders[:1])  # the extender's pods name no order
    ]


@dataclass(frozen=True, slots=True)
class Run:
    outcome: Outcome
    #: from the first pod's creation (kube-scheduler just started) to the last pod's decision
    seconds: float
    late: int
    #: ResourceSlice writes that reordered devices (DRA+order)
    slice_writes: int = 0


class SliceOrder:
    """Each node's ResourceSlice with its devices least free first, rewritten when the order changes, as
    the node agent's SlicePublisher does with ``--dra-order best-fit``."""

    def __init__(self, resource: client.ResourceV1Api, cards: Mapping[str, Sequence[Card]]) -> None:
        self.resource, self.cards = resource, cards
        self.orders = {node: self._order(node, {}) for node in cards}
        self.writes = 0

    def _order(self, node: str, used: Mapping[int, int]) -> tuple[int, ...]:
        return best_fit_order(card_rooms(self.cards[node], GIB, used))

    def follow(self, claims: Sequence[Mapping[str, Any]]) -> None:
        """Rewrite the slice of each node whose best-fit order changed with what ``claims`` consume."""
        used: dict[str, dict[int, int]] = {}
        for held in dra_shares(claims).values():
            for share in held:
                on_node = used.setdefault(share.node, {})
                on_node[share.index] = on_node.get(share.index, 0) + share.gib * GIB.bytes
        for node in self.cards:
            order = self._order(node, used.get(node, {}))
            if order != self.orders[node]:
                self.write(node, order)
                self.writes += 1

    def write(self, node: str, order: Sequence[int]) -> None:
        name = dra_slice_name(node)
        live = self.resource.api_client.sanitize_for_serialization(self.resource.read_resource_slice(name))
        desired = resource_slice(node, self.cards[node], GIB, live_generation(live) + 1, order)
        desired["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        self.resource.replace_resource_slice(name, desired)
        self.orders[node] = tuple(order)

    def reset(self) -> None:
        """Every slice back in NVML index order, for the ways that come after."""
        for node, order in self.orders.items():
            if list(order) != sorted(order):
                self.write(node, sorted(order))


class Replay:
    """The cluster, its nodes' cards, and the pods in arrival order."""

    def __init__(
        self,
        cluster: RealCluster,
        cards: Mapping[str, Sequence[Card]],
        asks: Sequence[GpuAsk],
        args: argparse.Namespace,
    ) -> None:
        self.cluster, self.cards, self.asks = cluster, cards, asks
        self.policy, self.reorder_every = args.policy, args.reorder_every
        self.core = client.CoreV1Api(cluster.api)
        self.resource = client.ResourceV1Api(cluster.api)
        self.card_sizes = sorted({GIB.units_of(c.memory_mib) for node in cards.values() for c in node})

    def _claims(self, run: str) -> list[dict[str, Any]]:
        listed = call(
            "list ResourceClaims",
            self.resource.list_namespaced_resource_claim,
            NAMESPACE,
            label_selector=f"{RUN_LABEL}={run}",
        )
        return listed.get("items") or []

    def run(self, column: Column, run: str) -> Run:
        way = column.way
        asks = [replace(ask, pod=f"{run}-{i:03d}") for i, ask in enumerate(self.asks)]
        order = SliceOrder(self.resource, self.cards) if way == "DRA+order" else None
        decisions = Decisions()
        watch = WatchCache(self.cluster.api, "pods", label_selector=f"{RUN_LABEL}={run}")
        watch.add_listener(decisions)
        watch.start()
        extender: Process | None = None
        scheduler: Process | None = None
        try:
            watch.wait_synced(60)
            url = None
            if way in EXTENDER_WAYS:
                steering = ["--dra-steering"] if way in CLAIM_WAYS else []
                extender, url = nodeless.start_extender(self.cluster, f"extender-{run}", self.policy, flags=steering)
            config = nodeless.scheduler_config(self.cluster, url, QPS, host_only=way in CLAIM_WAYS)
            scheduler, _ = nodeless.start_scheduler(self.cluster, run, config)
            started = time.monotonic()
            for i, ask in enumerate(asks, 1):
                self.submit(column, run, ask)
                decisions.wait(ask.pod, DECISION_TIMEOUT, scheduler.check)
                if order is not None and i % self.reorder_every == 0:
                    order.follow(self._claims(run))
            seconds = time.monotonic() - started
            pods = list_pods(self.cluster.api, label_selector=f"{RUN_LABEL}={run}")
            bound = {p["metadata"]["name"] for p in pods if (p.get("spec") or {}).get("nodeName")}
            if way not in CLAIM_WAYS:
                shares = extender_shares(list_nodes(self.cluster.api), pods)
            else:
                shares = dra_shares(self._claims(run))
            writes = 0 if order is None else order.writes
            result = Run(outcome(self.cards, shares, asks, bound), seconds, len(decisions.late), writes)
        finally:
            for process in (scheduler, extender):
                if process is not None:
                    process.stop()
            watch.stop()
            if order is not None:
                order.reset()
        self.clean(run)
        return result

    def submit(self, column: Column, run: str, ask: GpuAsk) -> None:
        if not column.claims:
            self.core.create_namespaced_pod(NAMESPACE, nodeless.pod_body(ask.pod, run, extender_limits(ask)))
            return
        claim = {
            "metadata": {"name": ask.pod, "namespace": NAMESPACE, "labels": {RUN_LABEL: run}},
            "spec": dra_claim_spec(ask, self.card_sizes, column.largest_first),
        }
        self.resource.create_namespaced_resource_claim(NAMESPACE, claim)
        self.core.create_namespaced_pod(NAMESPACE, nodeless.pod_body(ask.pod, run, {}, claim=ask.pod))

    def clean(self, run: str) -> None:
        """The run's pods and claims gone (kube-controller-manager releases a claim once its pod is)."""
        nodeless.delete_run_pods(self.core, run)
        nodeless.delete_run_claims(self.resource, run)


def build_cluster(cluster: RealCluster, nodes: Sequence[tuple[str, str]]) -> dict[str, list[Card]]:
    """The nodes, their ResourceSlices and the DeviceClass; each node's cards."""
    cards = {name: simulated_cards(name, spec) for name, spec in nodes}
    with ThreadPoolExecutor(8) as pool:
        nodeless.create_nodes(client.CoreV1Api(cluster.api), pool, nodes)
        resource = client.ResourceV1Api(cluster.api)
        list(pool.map(lambda name: resource.create_resource_slice(resource_slice(name, cards[name], GIB, 1)), cards))
    utils.create_from_yaml(cluster.api, str(DEVICE_CLASS))
    return cards


def figures(runs: Mapping[str, Run], reference: GpuAsk | None, sizes: Sequence[int]) -> dict[str, dict[str, float]]:
    """Per table row, each column's figure for one round; ``sizes``: the cluster's card sizes (GiB)."""
    rows: dict[str, dict[str, float]] = {}
    for way, run in runs.items():
        out = run.outcome
        values = {
            "pods placed": len(out.placed),
            "  of them shares of a card": sum(1 for a in out.placed if not a.whole),
            "  of them whole-card pods": sum(1 for a in out.placed if a.whole),
            "pods left Pending": len(out.pending),
            **{f"whole cards taken of {size} GiB": out.whole_cards.get(size, 0) for size in sizes},
            "GPU memory allocated (GiB)": out.allocated_gib,
            "GPU memory allocated (% of cluster)": out.allocated_percent,
            "cards allocated (%, each card 100% whatever its size)": out.allocated_card_percent,
            "empty cards": out.empty_cards,
            "cards partly used": out.partly_used_cards,
            "GiB free on partly used cards": out.free_on_partly_used,
            **{
                f"  of them on {size} GiB cards": sum(
                    c.free for c in out.loads if c.capacity == size and 0 < c.used < c.capacity
                )
                for size in sizes
            },
            "GiB free on cards that can't hold the median Pending ask": (
                out.unusable_for(reference) if reference else float("nan")
            ),
            "pods bound after being found Unschedulable": run.late,
            "ResourceSlice writes reordering devices": run.slice_writes,
            "seconds from first pod to last decision": run.seconds,
        }
        for row, value in values.items():
            rows.setdefault(row, {})[way] = value
    return rows


def table(rounds: Sequence[dict[str, dict[str, float]]], cols: Sequence[Column]) -> str:
    """The medians over rounds (those with a figure: a round with no pod left Pending has no median
    Pending ask), the columns side by side and, with the extender run, each DRA column's ratio to it."""
    width = max(len(row) for row in rounds[0])
    labels = [c.label for c in cols]
    extender = next((c.label for c in cols if c.way == "extender"), None)
    ratios = [c.label for c in cols if c.claims] if extender else []
    cell = max(9, *(len(label) for label in labels))
    header = [*(f"{label:>{cell}}" for label in labels), *(f"{label + '/ext':>{cell + 4}}" for label in ratios)]
    lines = [f"{'':{width}}  " + "  ".join(header)]
    for row in rounds[0]:
        known = [r[row] for r in rounds if not any(math.isnan(v) for v in r[row].values())]
        if not known:
            dashes = [f"{'-':>{cell}}"] * len(labels) + [f"{'-':>{cell + 4}}"] * len(ratios)
            lines.append(f"{row:{width}}  " + "  ".join(dashes))
            continue
        medians = {label: statistics.median(r[label] for r in known) for label in labels}
        ext = medians[extender] if extender else 0
        cells = [*(f"{medians[label]:{cell}.1f}" for label in labels)]
        cells += [f"{medians[label] / ext:{cell + 4}.2f}" if ext else f"{'-':>{cell + 4}}" for label in ratios]
        lines.append(f"{row:{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def describe(asks: Sequence[GpuAsk], cards: Mapping[str, Sequence[Card]], nodes: Sequence[tuple[str, str]]) -> str:
    shares = [a for a in asks if not a.whole]
    whole = [a for a in asks if a.whole]
    groups: dict[str, int] = {}
    for _, spec in nodes:
        groups[spec] = groups.get(spec, 0) + 1
    all_cards = [c for node in cards.values() for c in node]
    return (
        f"pods: {len(shares)} shares of one card ({sum(a.gib * a.cards for a in shares)} GiB), "
        f"{len(whole)} whole-card pods ({sum(a.cards for a in whole)} cards)\n"
        f"cluster: {len(nodes)} nodes ({', '.join(f'{n} x {spec}' for spec, n in groups.items())}), "
        f"{len(all_cards)} cards, {sum(GIB.units_of(c.memory_mib) for c in all_cards)} GiB"
    )


def replay_rounds(
    args: argparse.Namespace, nodes: Sequence[tuple[str, str]], asks: Sequence[GpuAsk], cols: Sequence[Column]
) -> list[dict[str, dict[str, float]]]:
    """Every column ``--rounds`` times on one cluster, their order rotating; each round's figures."""
    rounds = []
    with real_cluster(
        "gs-dra-", (), args.keep, scheduler_names=(), controllers=("*", "-node-lifecycle-controller")
    ) as cluster:  # fmt: skip
        cards = build_cluster(cluster, nodes)
        print(f"{args.trace} seed {args.seed}, {args.pods} GPU pods, shares of a {args.card_gib} GiB card", flush=True)
        print(describe(asks, cards, nodes), flush=True)
        replay = Replay(cluster, cards, asks, args)
        for round_ in range(args.rounds):
            runs = {}
            shift = round_ % len(cols)
            for col in [*cols[shift:], *cols[:shift]]:
                name = f"r{round_}-{col.way.lower().replace('+', '-')}{'-large' if col.largest_first else ''}"
                run = runs[col.label] = replay.run(col, name)
                out = run.outcome
                print(
                    f"round {round_ + 1} {col.label}: {len(out.placed)} placed, {len(out.pending)} Pending, "
                    f"{out.allocated_gib} GiB allocated, {out.free_on_partly_used} GiB free on partly used "
                    f"cards, {run.slice_writes} slice writes, {run.seconds:.0f}s",
                    flush=True,
                )
            reference = median_ask(a for run in runs.values() for a in run.outcome.pending)
            print(f"round {round_ + 1}: median Pending ask {reference or 'none'}", flush=True)
            rounds.append(figures(runs, reference, replay.card_sizes))
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="gpushare40", help="openb trace variant: default, gpushare40, ...")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    parser.add_argument("--pods", type=int, default=300, help="GPU pods replayed, in arrival order")
    parser.add_argument("--seed", type=int, default=42, help="the arrival order's seed (the paper's shuffle)")
    parser.add_argument("--card-gib", type=int, default=32, help="GiB of the card a trace pod's share is of")
    parser.add_argument("--nodes", default=DEFAULT_NODES, help="COUNT*CARDS groups separated by ';'")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every way, order rotating; medians")
    parser.add_argument("--policy", default="", help=f"the extender's placement policy (default {DEFAULT_POLICY})")
    parser.add_argument(
        "--whole-cards",
        choices=("smallest", "largest", "both"),
        default="smallest",
        help="which card size a DRA whole-card claim lists first (kube-scheduler prefers it); both: each DRA "
        "way runs once with each",
    )
    parser.add_argument(
        "--ways", default=",".join(WAYS), help=f"the ways run, separated by commas (of {', '.join(WAYS)})"
    )
    parser.add_argument(
        "--reorder-every",
        type=int,
        default=1,
        help="DRA+order: rewrite the slices after every this many pods' decisions (a node agent that coalesces "
        "the claim changes of a burst)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs) afterwards")
    args = parser.parse_args()
    if args.rounds < 1 or args.reorder_every < 1:
        parser.error("--rounds and --reorder-every must be at least 1")
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if unknown := [w for w in ways if w not in WAYS] or (not ways and ["(none)"]):
        parser.error(f"--ways: {', '.join(unknown)} is not one of {', '.join(WAYS)}")
    cols = columns(ways, args.whole_cards)
    try:
        nodes = parse_nodes(args.nodes)
        asks = arrivals(
            load_pods(args.trace_dir / f"openb_pod_list_{args.trace}.csv"), args.pods, args.seed, args.card_gib
        )
    except (ValueError, TraceError, ReplayError) as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.WARNING)
    started = time.monotonic()
    try:
        rounds = replay_rounds(args, nodes, asks, cols)
    except (ClusterError, ReplayError, ApiException) as exc:
        print(f"dra_replay: {exc}", file=sys.stderr)
        return 1
    whole = "smallest and the largest (<, >)" if args.whole_cards == "both" else args.whole_cards
    print(
        f"\nKubernetes {KUBE_VERSION}; extender policy {args.policy or DEFAULT_POLICY}; DRA whole-card claims "
        f"list the {whole} cards first; "
        f"medians of {args.rounds} round(s); {time.monotonic() - started:.0f}s in all"
    )
    print(table(rounds, cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
