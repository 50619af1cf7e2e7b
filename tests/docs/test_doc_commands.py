"""Every fenced shell block of the docs says whether it runs offline, and every one that says so runs,
as written, in a few seconds (the convention is in CONTRIBUTING.md, "Commands in the docs")."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from docfiles import ROOT, SHELL_LANGUAGES, Block, blocks, doc_files

#: what a shell block may be labelled with; only ``offline`` blocks are run
LABELS = frozenset({"offline", "cluster", "node", "root", "sandbox", "long"})
#: seconds an offline block may take
TIMEOUT = 30


def shell_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path) if b.language in SHELL_LANGUAGES]


def offline_blocks() -> list[Block]:
    return [b for b in shell_blocks() if "offline" in b.labels]


def test_every_shell_block_says_whether_a_test_can_run_it() -> None:
    wrong = []
    for block in shell_blocks():
        labels = set(block.labels)
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
