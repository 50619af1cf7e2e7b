"""Reading the openb CSV format: one row per GPU node, one row per pod.

Nodes: ``sn,cpu_milli,memory_mib,gpu,model``. Pods: ``name,cpu_milli,memory_mib,num_gpu,gpu_milli`` and
optionally ``gpu_spec`` (acceptable card models separated by ``|``; empty means any); further columns
(qos, phase, times) are ignored. A card is 1000 milli whatever its model. Every problem is reported
with the file, the line and the column at fault.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpushare.contract.cardrule import parse_models as models_of
from gpushare.contract.errors import AnnotationError
from gpushare.placement.model import Shape

MILLI_PER_CARD = 1000
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
OPTIONAL_POD_COLUMNS = ("gpu_spec",)


class TraceError(ValueError):
    """A CSV that can't be replayed; the message names the file, line and column."""


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
    models: frozenset[str] = frozenset()
    #: the models as the file lists them (the paper's simulator keys typical pods on this text)
    spec: str = ""

    @property
    def gpu_request(self) -> int:
        """Milli-GPUs requested in total."""
        return self.num_gpu * self.gpu_milli

    @property
    def shape(self) -> Shape:
        """The GPU request as a placement shape: whole cards, a share of each card, or none."""
        if not self.num_gpu:
            return Shape(0, 0)
        if self.gpu_milli >= MILLI_PER_CARD:
            return Shape(0, self.num_gpu, exclusive=True)
        return Shape(self.gpu_milli, self.num_gpu)


def parse_models(spec: str, where: str = "gpu_spec") -> frozenset[str]:
    """The card models a ``gpu_spec`` accepts, read as the extender reads the pod annotation
    ``gpushare.io/gpu-model`` (empty: any model); raises AnnotationError."""
    return models_of(spec, where) if spec.strip("| ") else frozenset()


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, Callable[[str], str]]]:
    """(line number, cell reader) for each data row; the header must have ``required``."""
    try:
        handle = path.open(newline="")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceError(f"{path}: can't be read: {exc.strerror}") from None
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path} line 1: empty file, expected a header with columns {','.join(required)}")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(f"{path} line 1: header lacks column(s) {', '.join(missing)} (has {','.join(header)})")
        index = {name: i for i, name in enumerate(header)}
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) < len(header):
                row = row + [""] * (len(header) - len(row))

            def cell(column: str, row: list[str] = row) -> str:
                return row[index[column]].strip() if column in index else ""

            yield line, cell


def _int(path: Path, line: int, column: str, text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{path} line {line} column {column}: {text!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise TraceError(f"{path} line {line} column {column}: {value} must be {bound}")
    return value


def load_nodes(path: Path) -> list[TraceNode]:
    """The nodes of ``path``; raises TraceError."""
    nodes: list[TraceNode] = []
    seen: dict[str, int] = {}
    for line, cell in _rows(path, NODE_COLUMNS):
        name = cell("sn")
        if not name:
            raise TraceError(f"{path} line {line} column sn: empty node name")
        if name in seen:
            raise TraceError(f"{path} line {line} column sn: node {name} already on line {seen[name]}")
        seen[name] = line
        nodes.append(
            TraceNode(
                name,
                _int(path, line, "cpu_milli", cell("cpu_milli"), 0),
                _int(path, line, "memory_mib", cell("memory_mib"), 0),
                _int(path, line, "gpu", cell("gpu"), 1, 64),
                cell("model"),
            )
        )
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return nodes


def load_pods(path: Path) -> list[TracePod]:
    """The pods of ``path``; a pod without GPUs has ``gpu_milli`` 0 and no model constraint whatever the file
    says. Raises TraceError."""
    pods: list[TracePod] = []
    for line, cell in _rows(path, POD_COLUMNS):
        name = cell("name")
        if not name:
            raise TraceError(f"{path} line {line} column name: empty pod name")
        num_gpu = _int(path, line, "num_gpu", cell("num_gpu"), 0, 64)
        milli = _int(path, line, "gpu_milli", cell("gpu_milli") or "0", 0, MILLI_PER_CARD)
        if num_gpu and not milli:
            raise TraceError(f"{path} line {line} column gpu_milli: pod {name} asks for {num_gpu} GPU(s) of 0 milli")
        spec = "|".join(m for m in cell("gpu_spec").split("|") if m) if num_gpu else ""
        try:
            models = parse_models(spec, f"{path} line {line} column gpu_spec")
        except AnnotationError as exc:
            raise TraceError(str(exc)) from None
        pods.append(
            TracePod(
                name=name,
                cpu_milli=_int(path, line, "cpu_milli", cell("cpu_milli"), 0),
                memory_mib=_int(path, line, "memory_mib", cell("memory_mib"), 0),
                num_gpu=num_gpu,
                gpu_milli=milli if num_gpu else 0,
                models=models,
                spec=spec,
            )
        )
    if not pods:
        raise TraceError(f"{path}: no pods")
    return pods
