"""A live cluster as the two replay CSVs: its GPU nodes (from the advertiser's inventory annotation) and its
GPU pods' requests, each card share expressed in milli of a card.

A pod's share is its units per card over the units of the card it holds (or, for a pod not placed yet,
of the cluster's most common card size). A pod with several GPU containers is recorded as one request
of their summed share (or whole cards); the replay, like the openb trace, knows one request per pod.
"""

from __future__ import annotations

import csv
import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes.utils import parse_quantity

from gpushare.contract.errors import ContractError
from gpushare.contract.inventory import parse_inventory
from gpushare.contract.names import NODE_ANN_INVENTORY
from gpushare.contract.request import parse_pod_request, requests_gpu
from gpushare.kube.objects import list_nodes, list_pods
from gpushare.simulate.trace import MILLI_PER_CARD, NODE_COLUMNS, POD_COLUMNS
from gpushare.usage import holds_resources

log = logging.getLogger(__name__)


def _milli_cpu(value: Any) -> int:
    return int(parse_quantity(value) * 1000) if value else 0


def _mib(value: Any) -> int:
    return int(parse_quantity(value) / (1 << 20)) if value else 0


def _requests(pod: Mapping[str, Any]) -> tuple[int, int]:
    cpu = mem = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        req = (c.get("resources") or {}).get("requests") or {}
        cpu += _milli_cpu(req.get("cpu"))
        mem += _mib(req.get("memory"))
    return cpu, mem


def snapshot(api: Any, out: Path) -> tuple[Path, Path]:
    """Write ``out/nodes.csv`` and ``out/pods.csv`` from the cluster behind ``api``; returns their paths."""
    card_units: dict[str, int] = {}
    node_rows = []
    for node in list_nodes(api):
        meta, status = node.get("metadata") or {}, node.get("status") or {}
        name = meta.get("name", "")
        text = (meta.get("annotations") or {}).get(NODE_ANN_INVENTORY)
        if not text:
            continue
        try:
            inventory = parse_inventory(text, name)
        except ContractError as exc:
            log.warning("node %s left out of the snapshot: %s", name, exc)
            continue
        cards = [c for c in inventory.cards if c.healthy]
        if not cards:
            continue
        card_units[name] = Counter(inventory.units_of(c) for c in cards).most_common(1)[0][0]
        model = Counter(c.model for c in cards).most_common(1)[0][0]
        allocatable = status.get("allocatable") or {}
        node_rows.append([name, _milli_cpu(allocatable.get("cpu")), _mib(allocatable.get("memory")), len(cards), model])
    usual = Counter(card_units.values()).most_common(1)[0][0] if card_units else 1
    pod_rows = []
    for pod in list_pods(api):
        if not requests_gpu(pod) or not holds_resources(pod):
            continue
        try:
            request = parse_pod_request(pod)
        except ContractError as exc:
            log.warning("pod left out of the snapshot: %s", exc)
            continue
        containers = request.gpu_containers
        cpu, mem = _requests(pod)
        if any(c.exclusive for c in containers):
            num, milli = sum(c.cards for c in containers), MILLI_PER_CARD
        else:
            units = card_units.get((pod.get("spec") or {}).get("nodeName") or "", usual)
            num = max(c.cards for c in containers)
            share = sum(c.units_per_card for c in containers) * MILLI_PER_CARD // units
            milli = max(1, min(MILLI_PER_CARD, share))
        pod_rows.append([request.key, cpu, mem, num, milli, ""])
    nodes_csv, pods_csv = out / "nodes.csv", out / "pods.csv"
    with nodes_csv.open("w", newline="") as f:
        csv.writer(f).writerows([NODE_COLUMNS, *node_rows])
    with pods_csv.open("w", newline="") as f:
        csv.writer(f).writerows([(*POD_COLUMNS, "gpu_spec"), *pod_rows])
    return nodes_csv, pods_csv
