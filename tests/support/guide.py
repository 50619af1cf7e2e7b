"""The operator's guide (docs/operations.md) run as written on a :class:`ShippedCluster`: each shell block
labelled ``e2e:STEP`` is a step, run where its other label says (``cluster``: the administrator's shell,
on the control-plane machine with admin.conf; ``control-plane``: that machine; ``node``: each node).

A block naming ``<node>`` or ``<gpu-node>`` is run once per node with the name put in. The only other
things the runner provides are what stands for the machine's own tools: ``sudo`` (the steps already
run as root) and ``systemctl``, whose ``restart kubelet`` restarts that node's kubelet process once the
block is done, as systemd would. Nothing else of a block is changed."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpushare.sandbox.shippedcluster import CONTROL_PLANE, ShippedCluster
from support.docfiles import OPERATIONS, ROOT, Block, blocks, e2e_step, headings

#: what a block's location label names, and where it runs
LOCATIONS = ("cluster", "control-plane", "node")
NODE_PLACEHOLDER = re.compile(r"<(?:gpu-)?node>")
#: the machine's tools, as a step's shell finds them
TOOLS = """sudo() { "$@"; }
systemctl() { printf '%s\\n' "$*" >>"$GPUSHARE_SYSTEMCTL"; }
"""


def guide_steps(within: str | None = None) -> dict[str, Block]:
    """Every ``e2e:STEP`` block of the guide, by step; with ``within``, only those under that heading
    (its exact text, down to the next heading of its level or higher)."""
    lines = range(1, len(OPERATIONS.read_text().splitlines()) + 1)
    if within is not None:
        marks = headings(OPERATIONS)
        found = [(n, lv) for n, lv, text in marks if text == within]
        assert found, f"{OPERATIONS.name} has no heading {within!r}"
        (start, level), *_ = found
        lines = range(start, next((n for n, lv, _ in marks if n > start and lv <= level), lines.stop))
    steps = {}
    for block in blocks(OPERATIONS):
        for label in block.labels:
            if (step := e2e_step(label)) is not None and block.line in lines:
                steps[step] = block
    return steps


def workspace(directory: Path) -> Path:
    """A working directory in which the repository's files are reachable under their usual names, as
    in a checkout the operator runs the guide from."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv"}:
            (directory / entry.name).symlink_to(entry)
    return directory


@dataclass
class Guide:
    cluster: ShippedCluster
    cwd: Path
    steps: dict[str, Block] = field(default_factory=guide_steps)
    ran: list[str] = field(default_factory=list)

    def run(self, step: str, nodes: Sequence[str] | None = None) -> str:
        """Run the step (on ``nodes``, default every node, where it is per node); its output. The test
        fails with the block, where it ran and its output if any run exits non-zero."""
        block = self.steps[step]
        where = [label for label in block.labels if label in LOCATIONS]
        assert len(where) == 1, f"{block}: one of {LOCATIONS} says where it runs, not {block.labels}"
        per_node = where[0] == "node" or NODE_PLACEHOLDER.search(block.text) is not None
        outputs = []
        for node in (nodes or list(self.cluster.nodes)) if per_node else [None]:
            machine = node if where[0] == "node" else CONTROL_PLANE
            text = NODE_PLACEHOLDER.sub(node, block.text) if node else block.text
            outputs.append(self._run_block(block, step, machine, text))
        self.ran.append(step)
        return "".join(outputs)

    def _run_block(self, block: Block, step: str, machine: str, text: str) -> str:
        requests = self.cwd / f".systemctl-{step}-{machine}"
        requests.unlink(missing_ok=True)
        done = self.cluster.run_on(machine, TOOLS + text, self.cwd, {"GPUSHARE_SYSTEMCTL": str(requests)})
        assert done.returncode == 0, f"{block} ({step}) on {machine}: exit {done.returncode}:\n{text}\n{done.stdout}"
        for request in requests.read_text().splitlines() if requests.exists() else []:
            assert request == "restart kubelet" and machine in self.cluster.nodes, (
                f"{block} ({step}) on {machine}: `systemctl {request}` stands for nothing here"
            )
            self.cluster.restart_kubelet(machine)
        return done.stdout
