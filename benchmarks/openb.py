"""Loading Alibaba's openb GPU-sharing trace (cluster-trace-gpu-v2023) into plain records."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

TRACE_DIR = Path("/work/shared/traces/openb")
NODE_FILE = "openb_node_list_gpu_node.csv"
MILLI_PER_CARD = 1000


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class TracePod:
    """``gpu_milli`` is the share of each of ``num_gpu`` cards; ``models`` empty means any model."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    models: frozenset[str]

    @property
    def gpu_request(self) -> int:
        """Milli-GPUs requested in total."""
        return self.num_gpu * self.gpu_milli


def pod_file(trace: str) -> str:
    return f"openb_pod_list_{trace}.csv"


def load_nodes(path: Path) -> list[TraceNode]:
    with path.open(newline="") as f:
        return [
            TraceNode(row["sn"], int(row["cpu_milli"]), int(row["memory_mib"]), int(row["gpu"]), row["model"])
            for row in csv.DictReader(f)
        ]


def load_pods(path: Path) -> list[TracePod]:
    """Pods as listed; a pod without GPUs has ``gpu_milli`` 0 whatever the file says."""
    pods = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            num_gpu = int(row["num_gpu"])
            spec = row.get("gpu_spec") or ""
            pods.append(
                TracePod(
                    name=row["name"],
                    cpu_milli=int(row["cpu_milli"]),
                    memory_mib=int(row["memory_mib"]),
                    num_gpu=num_gpu,
                    gpu_milli=int(row["gpu_milli"]) if num_gpu else 0,
                    models=frozenset(m for m in spec.split("|") if m),
                )
            )
    return pods
