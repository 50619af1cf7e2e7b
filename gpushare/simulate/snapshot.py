"""A live cluster as the two replay CSVs: its GPU nodes (from the advertiser's inventory annotation) and its
GPU pods' requests, each card share expressed in milli of a card.

- A node of mixed cards lists each healthy card's model, in card order (``A100-40GB;A10;A10``).
- A pod's ``gpu_spec`` holds the models its card rule (``gpushare.io/gpu-model`` and ``-avoid``) accepts;
  the replay has no NVLink or NUMA topology, so those requirements are counted, not replayed.
- A placed pod's share is its units per card over the units of the card it holds; a pod not placed yet
  (no node, or no card recorded) is measured against the most common size among the cards its rule
  accepts. ``pod_phase`` records the pod's phase, as in the openb trace.
- A pod with several GPU containers is recorded as one request of their summed share (or whole cards);
  the replay, like the openb trace, knows one request per pod.
- A share larger than the card it is measured against (a pod no card can hold) can't be written as
  milli of that card: it is recorded as one whole card, with a warning naming the pod.
"""

from __future__ import annotations

import csv
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.cards import Card
from gpushare.contract.cardrule import format_models, parse_card_rule
from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import parse_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY, RESOURCE_MEM
from gpushare.contract.request import parse_pod_request, requests_gpu
from gpushare.contract.units import MIB_BYTES, parse_host_quantity
from gpushare.holdings.pod import holds_resources, pod_allocation
from gpushare.kube.objects import list_nodes, list_pods
from gpushare.placement.demand import CardRule
from gpushare.simulate.trace import CARD_MODEL_SEPARATOR, MILLI_PER_CARD, NODE_COLUMNS, POD_COLUMNS

log = logging.getLogger(__name__)

POD_FILE_COLUMNS = (*POD_COLUMNS, "gpu_spec", "pod_phase")


def _milli_cpu(value: Any, where: str) -> int:
    return parse_host_quantity(value, 1000, "millicores", where) if value else 0


def _mib(value: Any, where: str) -> int:
    return parse_host_quantity(value, 1, "bytes", where) // MIB_BYTES if value else 0


def _requests(pod: Mapping[str, Any], key: str) -> tuple[int, int]:
    """The pod's CPU (millicores) and memory (MiB) requests; QuantityError naming the container and
    field for one beyond the bounds every reader of a pod keeps to."""
    cpu = mem = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        req = (c.get("resources") or {}).get("requests") or {}
        where = f"pod {key} container {c.get('name')!r} requests"
        cpu += _milli_cpu(req.get("cpu"), f"{where} cpu")
        mem += _mib(req.get("memory"), f"{where} memory")
    return cpu, mem


@dataclass(frozen=True, slots=True)
class SnapshotNode:
    """A node's healthy cards and their sizes in the node's units."""

    name: str
    cards: tuple[Card, ...]
    units: dict[str, int]


@dataclass(slots=True)
class Snapshot:
    """The rows of the two CSVs, and what the user should know about how they were taken."""

    node_rows: list[list[Any]] = field(default_factory=list)
    pod_rows: list[list[Any]] = field(default_factory=list)
    cards: int = 0
    mixed: int = 0
    pending: int = 0
    topology: int = 0
    left_out: int = 0
    #: pods asking more of one card than the card they are measured against: recorded as whole cards
    oversized: int = 0
    nodes_csv: Path = Path("nodes.csv")
    pods_csv: Path = Path("pods.csv")

    def summary(self) -> str:
        parts = [
            f"cluster snapshot in {self.nodes_csv} and {self.pods_csv}: {len(self.node_rows)} node(s) with "
            f"{self.cards} card(s) ({self.mixed} of mixed models), {len(self.pod_rows)} GPU pod(s), "
            f"{self.pending} of them not placed yet"
        ]
        if self.topology:
            parts.append(f"{self.topology} pod(s)' NVLink or NUMA requirement is not replayed")
        if self.oversized:
            parts.append(
                f"{self.oversized} pod(s) ask more than a card holds, replayed as whole cards (see the warnings above)"
            )
        if self.left_out:
            parts.append(f"{self.left_out} object(s) left out (see the warnings above)")
        return "; ".join(parts)


def _node(node: Mapping[str, Any]) -> SnapshotNode | None:
    """The node's healthy cards, or None for a node without gpushare cards; ContractError when its
    inventory can't be read."""
    name = (node.get("metadata") or {}).get("name", "")
    text = ((node.get("metadata") or {}).get("annotations") or {}).get(NODE_ANN_INVENTORY)
    if not text:
        return None
    inventory = parse_inventory(text, name)
    cards = tuple(sorted((c for c in inventory.cards if c.healthy), key=lambda c: c.index))
    return SnapshotNode(name, cards, {c.uuid: inventory.units_of(c) for c in cards}) if cards else None


def _spec(rule: CardRule, models: Sequence[str]) -> str | None:
    """``gpu_spec`` for a card rule: its model patterns, or with models to avoid, the cluster's models it
    accepts; None when it accepts none of them (only ``avoid`` can do that here)."""
    if not rule.avoid:
        return format_models(rule.models)
    accepted = [m for m in models if rule.accepts(m)]
    if len(accepted) == len(models) and not rule.models:
        return ""
    return "|".join(accepted) or None


def take(nodes: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]) -> Snapshot:
    """The snapshot of these Node and Pod objects (pure: see the module doc for what is recorded)."""
    shot = Snapshot()
    gpu_nodes: dict[str, SnapshotNode] = {}
    for node in nodes:
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        where = f"node {(node.get('metadata') or {}).get('name')} allocatable"
        try:
            found = _node(node)
            cpu = _milli_cpu(allocatable.get("cpu"), f"{where} cpu")
            mem = _mib(allocatable.get("memory"), f"{where} memory")
        except ContractError as exc:
            log.warning("node left out of the snapshot: %s", exc)
            shot.left_out += 1
            continue
        if found is None:
            continue
        gpu_nodes[found.name] = found
        models = [c.model for c in found.cards]
        label = models[0] if len(set(models)) == 1 else CARD_MODEL_SEPARATOR.join(models)
        shot.node_rows.append([found.name, cpu, mem, len(models), label])
        shot.cards += len(models)
        shot.mixed += len(set(models)) > 1
    sizes = [(c.model, n.units[c.uuid]) for n in gpu_nodes.values() for c in n.cards]
    models = sorted({m for m, _ in sizes})
    for pod in pods:
        if not requests_gpu(pod) or not holds_resources(pod):
            continue
        try:
            request = parse_pod_request(pod)
            rule = parse_card_rule(pod)
            cpu, mem = _requests(pod, request.key)
        except ContractError as exc:
            log.warning("pod left out of the snapshot: %s", exc)
            shot.left_out += 1
            continue
        spec = _spec(rule, models)
        if spec is None:
            log.warning("pod %s left out of the snapshot: it accepts none of the cluster's card models", request.key)
            shot.left_out += 1
            continue
        shot.topology += rule.topology
        containers = request.gpu_containers
        held = _held_units(pod, gpu_nodes.get((pod.get("spec") or {}).get("nodeName") or ""))
        shot.pending += held is None
        if any(c.exclusive for c in containers):
            num, milli = sum(c.cards for c in containers), MILLI_PER_CARD
        else:
            accepted = [units for model, units in sizes if rule.accepts(model)] or [units for _, units in sizes]
            units = held or (Counter(accepted).most_common(1)[0][0] if accepted else 1)
            num = max(c.cards for c in containers)
            asked = sum(c.units_per_card for c in containers)
            share = asked * MILLI_PER_CARD // units
            if share > MILLI_PER_CARD:
                log.warning(
                    "pod %s asks %d %s units of one card, more than the %d of the card it %s: replayed as one "
                    "whole card",
                    request.key, asked, RESOURCE_MEM, units, "holds" if held else "is measured against",
                )  # fmt: skip
                shot.oversized += 1
            milli = max(1, min(MILLI_PER_CARD, share))
        phase = (pod.get("status") or {}).get("phase") or "Pending"
        shot.pod_rows.append([request.key, cpu, mem, num, milli, spec, phase])
    return shot


def _held_units(pod: Mapping[str, Any], node: SnapshotNode | None) -> int | None:
    """The units of the smallest card the pod holds on ``node``; None when it holds none that can be read."""
    if node is None:
        return None
    try:
        allocation = pod_allocation(pod, node.cards)
    except ContractError as exc:
        log.warning("pod's cards can't be read, so it is measured as not placed: %s", exc)
        return None
    held = [node.units[s.uuid] for slices in (allocation or {}).values() for s in slices if s.uuid in node.units]
    return min(held, default=None)


def snapshot(api: Any, out: Path) -> Snapshot:
    """Write ``out/nodes.csv`` and ``out/pods.csv`` from the cluster behind ``api``."""
    shot = take(list_nodes(api), list_pods(api))
    shot.nodes_csv, shot.pods_csv = out / "nodes.csv", out / "pods.csv"
    with shot.nodes_csv.open("w", newline="") as f:
        csv.writer(f).writerows([NODE_COLUMNS, *shot.node_rows])
    with shot.pods_csv.open("w", newline="") as f:
        csv.writer(f).writerows([POD_FILE_COLUMNS, *shot.pod_rows])
    return shot
