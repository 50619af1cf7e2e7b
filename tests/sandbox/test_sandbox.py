"""``gpushare sandbox`` from the command line, as a newcomer runs it: every example pod's outcome shows,
on a real Kubernetes where one can run here and on the stand-ins (``--standin``) everywhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.sandboxrun import leftovers

from gpushare.sandbox.containerd import containerd_available
from gpushare.sandbox.printout import KEEP_RUNNING_HINT
from gpushare.sandbox.realcluster import realcluster_available

GPU_EXAMPLES = ("shared-1", "shared-2", "multi-container", "two-cards")


def row(output: str, pod: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(f"{pod} "))


def sandbox(directory: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """A whole run, with ``directory`` as its $TMPDIR."""
    proc = subprocess.run(
        [sys.executable, "-m", "gpushare.cli", "sandbox", *flags],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TMPDIR": str(directory)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_says_how_to_keep_it_and_leaves_nothing(proc: subprocess.CompletedProcess[str], directory: Path) -> None:
    """Without --keep-running the cluster is gone when the command returns: no kubectl to offer, one line
    saying how to keep it, and its temporary directory is removed."""
    assert "kubectl --kubeconfig" not in proc.stdout and " is up" not in proc.stdout
    assert [line for line in proc.stdout.splitlines() if "--keep-running" in line] == [KEEP_RUNNING_HINT]
    assert leftovers(directory) == []


def assert_every_example_reported(out: str, running: str, no_gpu_env: str) -> None:
    for pod in GPU_EXAMPLES:
        assert running in row(out, pod), row(out, pod)
    # the 2-card pod got two distinct cards on one node
    assert row(out, "two-cards").count("card ") == 2
    too_big = row(out, "too-big")
    assert "Pending" in too_big and "0/2 nodes are available" in too_big, too_big
    # the non-GPU pod that asked for every GPU: the CRI shim gives it none
    env_rows = out.split("GPU environment of each container")[1]
    assert no_gpu_env in row(env_rows, "no-gpu-all-devices")
    assert "Per-card allocation" in out


def test_standin_sandbox_runs_every_example_and_exits_zero(directory: Path) -> None:
    proc = sandbox(directory, "--standin")
    real_containers = containerd_available() is None
    assert_every_example_reported(proc.stdout, "Running" if real_containers else "Admitted",
                                  "void" if real_containers else "all")  # fmt: skip
    # the extender's own reason, as the stand-in's scheduling loop reports it
    assert "largest free" in row(proc.stdout, "too-big")
    assert "[5/5]" in proc.stderr  # the progress display
    assert_says_how_to_keep_it_and_leaves_nothing(proc, directory)


@pytest.mark.skipif(realcluster_available() is not None, reason=f"no real cluster here: {realcluster_available()}")
def test_sandbox_runs_the_examples_on_real_kubernetes_and_leaves_nothing_behind(directory: Path) -> None:
    proc = sandbox(directory)
    assert_every_example_reported(proc.stdout, "Running", "void")
    # kube-scheduler's own resource fit turns node-b away; the extender, asked about node-a, says why
    too_big = row(proc.stdout, "too-big")
    assert "1 Insufficient aliyun.com/gpu-mem" in too_big and "1 no single card has 90 GiB free" in too_big
    assert "[4/4]" in proc.stderr
    # simulated cards have no driver to hold pods to their shares, and the report says so
    env_rows = proc.stdout.split("GPU environment of each container")[1]
    assert "not enforced: simulated card" in row(env_rows, "shared-1")
    # kubelets, containerd, its shims and the containers, the node agents, extender, scheduler, etcd,
    # the nodes' mount namespaces, and the run directory
    assert_says_how_to_keep_it_and_leaves_nothing(proc, directory)


@pytest.mark.skipif(realcluster_available() is not None, reason=f"no real cluster here: {realcluster_available()}")
def test_on_a_node_whose_driver_enforces_limits_each_pod_shows_its_share(directory: Path) -> None:
    proc = sandbox(directory, "--nvml-fake", "dgx-a100")
    env_rows = proc.stdout.split("GPU environment of each container")[1]
    # read back from the driver on the pod's cgroup: shared-1 asked for 4 GiB of one card
    assert re.search(r"card \d 4096 MiB\s*$", row(env_rows, "shared-1")), row(env_rows, "shared-1")
    assert row(env_rows, "no-gpu-all-devices").rstrip().endswith("none")
    assert_says_how_to_keep_it_and_leaves_nothing(proc, directory)


def test_without_the_binaries_the_sandbox_says_it_uses_the_standins(directory: Path) -> None:
    proc = sandbox(directory, "--no-containers")  # a real cluster needs containers, so this takes the stand-in path
    assert "using the API stand-in and kubelet emulator" in proc.stderr
