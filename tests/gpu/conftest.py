"""Prints what the real-GPU checks measured after pytest's own summary, so that the one command in
CONTRIBUTING.md ("Testing on a real GPU") gives the figures a report needs."""

from __future__ import annotations

import pytest

from gpu import machine


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if machine.FIGURES:
        terminalreporter.section("figures measured on this machine's GPUs")
        for line in machine.FIGURES:
            terminalreporter.write_line(line)
