"""``gpushare sandbox`` from the command line, as a newcomer runs it: every example pod's outcome shows."""

from __future__ import annotations

import subprocess
import sys

from gpushare.sandbox.containerd import containerd_available


def row(output: str, pod: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(f"{pod} "))


def test_sandbox_runs_every_example_and_exits_zero() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpushare.cli", "sandbox"], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    real_containers = containerd_available() is None
    running = "Running" if real_containers else "Admitted"
    for pod in ("shared-1", "shared-2", "multi-container", "two-cards"):
        assert running in row(out, pod), row(out, pod)
    too_big = row(out, "too-big")
    assert "Pending" in too_big and "0/2 nodes are available" in too_big and "largest free" in too_big
    # the 2-card pod got two distinct cards on one node
    assert row(out, "two-cards").count("card ") == 2
    # the non-GPU pod that asked for every GPU: the CRI shim gives it none
    env_rows = out.split("GPU environment of each container")[1]
    no_gpu = row(env_rows, "no-gpu-all-devices")
    assert ("void" if real_containers else "all") in no_gpu
    assert "Per-card allocation" in out
    assert "[5/5]" in proc.stderr  # the progress display
