"""Every flag is checked before anything starts: a value that can't be used is refused in one line with
exit code 2, and nothing was started or written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.placement import POLICIES


def gpushare(directory: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpushare.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(directory), "KUBECONFIG": str(directory / "none")},
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["sandbox", "--policy", "nope"], "argument --policy: 'nope' is not one of"),
        (["sandbox", "--node", "x=bogus"], "argument --node: 'x=bogus': simulated GPU spec part 'bogus'"),
        (["sandbox", "--node", "x"], "argument --node: 'x' is not NAME=COUNTxMODEL:MiB"),
        (["sandbox", "--node", "Node_A=1xT4:15360"], "node name 'Node_A' is not a lowercase DNS name"),
        (["sandbox", "--node", "a=1xT4:15360", "--node", "a=1xA10:24576"], "two nodes are named 'a'"),
        (["sandbox", "--nvml-fake", "nope"], "argument --nvml-fake: no machine 'nope'"),
        (["sandbox", "--dra-cards", "node-a"], "argument --dra-cards: 'node-a' is not NODE=CARDS"),
        (["sandbox", "--dra-cards", "node-a=first"], "expected 'all' or card indexes / GPU- UUIDs"),
        (["sandbox", "--dra-cards", "node-z=all"], "--dra-cards node-z=all: no node 'node-z' (nodes: node-a, node-b)"),
        (["sandbox", "--dra-cards", "node-b=3"], "node 'node-b': --dra-cards names 3, not a card of this node"),
        (["sandbox", "--dra-cards", "node-a=0", "--dra-cards", "node-a=1"], "--dra-cards names node 'node-a' twice"),
        (["extender", "--policy", "nope"], "argument --policy: 'nope' is not one of"),
        (["--log-level", "nope", "inspect"], "argument --log-level: 'nope' is not one of debug, info"),
    ],
)
def test_a_bad_flag_is_refused_in_one_line_before_anything_starts(directory: Path, argv: list[str], says: str) -> None:
    done = gpushare(directory, *argv)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == ""
    assert list(directory.iterdir()) == []  # no run directory: nothing was started


def test_dra_cards_on_the_stand_ins_is_refused_in_one_line_before_anything_starts(directory: Path) -> None:
    """The stand-ins have no DRA allocator or kubelet plugin: a claim could never run there."""
    done = gpushare(directory, "sandbox", "--standin", "--dra-cards", "node-a=all")
    assert done.returncode == 1, done.stderr
    assert done.stderr == "gpushare sandbox: --dra-cards needs the real Kubernetes: --standin asks for the stand-ins\n"
    assert done.stdout == "" and list(directory.iterdir()) == []


def test_the_policy_flags_help_names_every_policy(directory: Path) -> None:
    for command in ("sandbox", "extender"):
        help_text = " ".join(gpushare(directory, command, "--help").stdout.split())
        assert all(name in help_text for name in POLICIES), help_text


def test_a_good_log_level_is_taken_in_any_case(directory: Path) -> None:
    done = gpushare(directory, "--log-level", "WARNING", "inspect", "--kubeconfig", str(directory / "none"))
    assert "--log-level" not in done.stderr and done.returncode == 1, done.stderr
