"""The sandbox runs kube-scheduler with the feature gates docs/operations.md has operators set beside the
extender (the tests' figures then hold for what a user runs)."""

from __future__ import annotations

from pathlib import Path

from support.docfiles import OPERATIONS, section

from gpushare.sandbox.controlplane import SCHEDULER_FEATURE_GATES, scheduler_argv


def test_operations_md_sets_the_feature_gates_the_sandbox_runs_kube_scheduler_with() -> None:
    flag = f"--feature-gates={','.join(SCHEDULER_FEATURE_GATES)}"
    assert flag in scheduler_argv(Path("scheduler-config.yaml"), 10259)
    for way in ("Patch the default scheduler", "Run a second scheduler"):
        assert flag in section(OPERATIONS, way), f"docs/operations.md, {way!r}: no {flag}"
