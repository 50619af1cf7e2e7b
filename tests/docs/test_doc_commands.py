"""Every fenced shell block of the docs says whether it runs offline, and every one that says so runs,
as written, in a few seconds; every command of docs/operations.md is run by a test or the doc says why
not (the convention is in CONTRIBUTING.md, "Commands in the docs")."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.docfiles import OPERATIONS, ROOT, SHELL_LANGUAGES, Block, blocks, doc_files, e2e_step, prose_lines

#: what a shell block may be labelled with; ``offline`` blocks are run here, ``e2e:STEP`` ones by
#: tests/install on a real cluster (on a node, the control-plane machine or as the administrator)
LABELS = frozenset({"offline", "cluster", "node", "control-plane", "root", "sandbox", "long"})
#: lines of prose around a block that isn't run in which the doc says why not
WHY_NOT_REACH = 6
#: seconds an offline block may take
TIMEOUT = 30


def shell_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path) if b.language in SHELL_LANGUAGES]


def offline_blocks() -> list[Block]:
    return [b for b in shell_blocks() if "offline" in b.labels]


def test_every_shell_block_says_whether_a_test_can_run_it() -> None:
    wrong = []
    for block in shell_blocks():
        labels = {label for label in block.labels if e2e_step(label) is None}
        if not labels:
            wrong.append(f"{block}: no label (one of {', '.join(sorted(LABELS))})")
        elif unknown := labels - LABELS:
            wrong.append(f"{block}: unknown label(s) {', '.join(sorted(unknown))}")
        elif "offline" in labels and len(labels) > 1:
            wrong.append(f"{block}: 'offline' beside {', '.join(sorted(labels - {'offline'}))}")
    assert not wrong, "\n".join(wrong)


def test_the_docs_have_commands_that_run_offline() -> None:
    assert len(offline_blocks()) >= 4, [str(b) for b in offline_blocks()]


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """An empty working directory in which the repository's files are reachable under their usual names."""
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv"}:
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


@contextlib.contextmanager
def session(block: Block, cwd: Path) -> Iterator[subprocess.Popen[str]]:
    """``bash`` running ``block`` in a process group of its own, which is killed however the test ends."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "KUBECONFIG": str(cwd / "no-such-kubeconfig"),  # nothing reaches a real cluster by accident
    }
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.parametrize("block", offline_blocks(), ids=str)
def test_an_offline_command_runs_as_written(block: Block, scratch: Path) -> None:
    with session(block, scratch) as proc:
        try:
            output, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block}: still running after {TIMEOUT} s:\n{block.text}")
    assert proc.returncode == 0, f"{block}: exit code {proc.returncode}:\n{block.text}\n--- output ---\n{output}"


def test_every_command_of_the_operations_guide_is_run_by_a_test_or_the_guide_says_why_not() -> None:
    prose = dict(prose_lines(OPERATIONS))
    unexplained, steps = [], []
    for block in shell_blocks():
        if block.path != OPERATIONS or "offline" in block.labels:
            continue
        if step := next(filter(None, map(e2e_step, block.labels)), None):
            steps.append(step)
            continue
        end = block.line + block.text.count("\n") + 1
        around = [prose.get(n, "") for n in range(block.line - WHY_NOT_REACH, end + WHY_NOT_REACH + 1)]
        if not any("tests" in line for line in around):
            unexplained.append(str(block))
    assert not unexplained, f"blocks no test runs, with no word on why: {unexplained}"
    assert len(steps) == len(set(steps)), f"e2e steps named twice: {sorted(steps)}"
    assert len(steps) >= 10, steps
