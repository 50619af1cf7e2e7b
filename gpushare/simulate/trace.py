"""Reading the openb CSV format: one row per GPU node, one row per pod.

Nodes: ``sn,cpu_milli,memory_mib,gpu,model``; ``model`` names every card's model, or, for a node of mixed
cards, one model per card separated by ``;`` (an extension of the openb format). Pods:
``name,cpu_milli,memory_mib,num_gpu,gpu_milli`` and optionally ``gpu_spec`` (acceptable card models
separated by ``|``; empty means any); further columns (qos, phase, times) are ignored. A card is 1000
milli whatever its model. Every problem is reported with the file, the line and the column at fault.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gpushare.contract.cardrule import parse_models as models_of
from gpushare.contract.errors import QUOTE_LIMIT, AnnotationError, quoted
from gpushare.placement.demand import CardRule, Shape

MILLI_PER_CARD = 1000
#: the most GPUs a node or a pod may have
MAX_GPUS = 64
#: bounds on a node's or a pod's CPU (a million vCPUs) and memory (1 EiB): far above any machine, and
#: low enough that a cluster's sums stay exact in the replay's 64-bit arrays
MAX_CPU_MILLI = 10**9
MAX_MEMORY_MIB = 2**40
#: separates the per-card models of a mixed node in the ``model`` column
CARD_MODEL_SEPARATOR = ";"
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
OPTIONAL_POD_COLUMNS = ("gpu_spec",)


class TraceError(ValueError):
    """A CSV that can't be replayed; the message names the file, line and column."""


@dataclass(frozen=True, slots=True)
class TraceNode:
    """``model`` as the file gives it; ``card_models`` holds each card's."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str
    card_models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.card_models:
            object.__setattr__(self, "card_models", (self.model,) * self.gpus)


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
    #: where the pod is in its file (0: not from a file)
    line: int = field(default=0, compare=False)

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


def _utf8(path: Path, line: int, row: list[str], header: list[str]) -> None:
    """Raises TraceError naming the first cell of ``row`` that held bytes that aren't UTF-8 (read as
    surrogate escapes)."""
    for i, cell in enumerate(row):
        try:
            cell.encode()
        except UnicodeEncodeError as exc:
            column = header[i] if i < len(header) else str(i + 1)
            byte = ord(cell[exc.start]) - 0xDC00
            raise TraceError(f"{path} line {line} column {column}: byte 0x{byte:02x} is not UTF-8") from None


def _csv_rows(path: Path, handle: TextIO) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of each CSV record; the csv module's errors (a field over its size limit, a
    NUL byte) as TraceError naming the line."""
    reader = csv.reader(handle)
    while True:
        try:
            row = next(reader, None)
        except csv.Error as exc:
            reason = str(exc)
            if reason.startswith("field larger than field limit"):
                reason = f"a field is longer than {csv.field_size_limit()} characters"
            raise TraceError(f"{path} line {reader.line_num}: {reason}") from None
        if row is None:
            return
        yield reader.line_num, row


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, Callable[[str], str]]]:
    """(line number, cell reader) for each data row; the header must have ``required``."""
    try:
        handle = path.open(newline="", encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceError(f"{path}: can't be read: {exc.strerror}") from None
    with handle:
        rows = _csv_rows(path, handle)
        _, header = next(rows, (0, None))
        if header is None:
            raise TraceError(f"{path} line 1: empty file, expected a header with columns {','.join(required)}")
        header = [h.strip() for h in header]
        _utf8(path, 1, header, header)
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(
                f"{path} line 1: header lacks column(s) {', '.join(missing)} (has {quoted(','.join(header))})"
            )
        index = {name: i for i, name in enumerate(header)}
        for line, row in rows:
            if not row or all(not cell.strip() for cell in row):
                continue
            _utf8(path, line, row, header)
            if len(row) < len(header):
                row = row + [""] * (len(header) - len(row))

            def cell(column: str, row: list[str] = row) -> str:
                return row[index[column]].strip() if column in index else ""

            yield line, cell


def _int(path: Path, line: int, column: str, text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{path} line {line} column {column}: {quoted(text)} is not an integer") from None
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        shown = text if len(text) <= QUOTE_LIMIT else f"{text[:20]}... ({len(text)} digits)"
        raise TraceError(f"{path} line {line} column {column}: {shown} must be {bound}")
    return value


def _card_models(path: Path, line: int, text: str, gpus: int) -> tuple[str, ...]:
    """Each card's model: ``text`` names one for all cards, or one per card separated by ``;``."""
    if CARD_MODEL_SEPARATOR not in text:
        return (text,) * gpus
    models = tuple(m.strip() for m in text.split(CARD_MODEL_SEPARATOR))
    if len(models) != gpus or not all(models):
        raise TraceError(
            f"{path} line {line} column model: {quoted(text)} names {len(models)} card model(s) for {gpus} GPU(s); "
            f"give one model, or one per card separated by '{CARD_MODEL_SEPARATOR}'"
        )
    return models


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
        gpus = _int(path, line, "gpu", cell("gpu"), 1, MAX_GPUS)
        nodes.append(
            TraceNode(
                name,
                _int(path, line, "cpu_milli", cell("cpu_milli"), 0, MAX_CPU_MILLI),
                _int(path, line, "memory_mib", cell("memory_mib"), 0, MAX_MEMORY_MIB),
                gpus,
                cell("model"),
                _card_models(path, line, cell("model"), gpus),
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
        num_gpu = _int(path, line, "num_gpu", cell("num_gpu"), 0, MAX_GPUS)
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
                cpu_milli=_int(path, line, "cpu_milli", cell("cpu_milli"), 0, MAX_CPU_MILLI),
                memory_mib=_int(path, line, "memory_mib", cell("memory_mib"), 0, MAX_MEMORY_MIB),
                num_gpu=num_gpu,
                gpu_milli=milli if num_gpu else 0,
                models=models,
                spec=spec,
                line=line,
            )
        )
    if not pods:
        raise TraceError(f"{path}: no pods")
    if not any(p.num_gpu for p in pods):
        raise TraceError(f"{path}: no pod requests a GPU, so there is no GPU allocation to replay")
    return pods


def unknown_models(path: Path, pods: Sequence[TracePod], nodes: Sequence[TraceNode]) -> list[str]:
    """A warning for each model a ``gpu_spec`` names that no node has (such a pod places only on its
    other models, or nowhere), naming the first line that names it and how many pods do."""
    present = {m for n in nodes for m in n.card_models}
    named = set().union(*(p.models for p in pods))
    missing = {p for p in named if not any(CardRule(frozenset({p})).accepts(m) for m in present)}
    asking: dict[str, list[int]] = {}
    for pod in pods:
        for pattern in sorted(pod.models & missing):
            asking.setdefault(pattern, []).append(pod.line)
    return [
        f"{path} line {lines[0]} column gpu_spec: no node has model {quoted(pattern)} "
        f"({len(lines)} pod(s) ask for it; the nodes have {', '.join(sorted(present)) or 'no model'})"
        for pattern, lines in asking.items()
    ]
