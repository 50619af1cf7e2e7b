"""Ctrl-C stops ``gpushare sandbox`` even when it started with SIGINT ignored, as a job started with
``cmd &`` from a script does (Python then installs no KeyboardInterrupt handler of its own)."""

from __future__ import annotations

import signal
from pathlib import Path

from support.sandboxrun import SandboxRun, leftovers


def test_sigint_stops_a_kept_running_standin_sandbox_that_inherited_it_ignored(directory: Path) -> None:
    run = SandboxRun(directory, "--standin", "--no-containers", "--keep-running", sigint_ignored=True)
    try:
        run.printed("Ctrl-C", 240)
        run.signal(signal.SIGINT)
        code = run.wait(60)
    finally:
        run.kill()
    # Ctrl-C is the way it asks to be stopped
    assert code == 0, run.err.text
    assert leftovers(directory) == []
