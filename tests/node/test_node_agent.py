"""``gpushare node`` as the DaemonSet runs it: one process publishes the inventory, registers both
resources with kubelet and serves the CRI shim on one watch of the node's pods, and stops cleanly on
SIGTERM."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from kubernetes import client
from support.waiting import wait_until

from gpushare.cli import build_parser
from gpushare.contract.names import NODE_ANN_INVENTORY, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.kube.objects import get_node
from gpushare.sandbox.apiserver import ApiServer
from gpushare.sandbox.kubeletemulator import KubeletEmulator


def test_node_agent_runs_all_node_components_on_one_pod_watch(
    apiserver: ApiServer, kubeconfig: Path, kube_api: client.ApiClient, core_v1: client.CoreV1Api
) -> None:
    core_v1.create_node({"metadata": {"name": "n1"}})
    directory = Path(tempfile.mkdtemp(prefix="agent", dir="/tmp"))
    kubelet = KubeletEmulator(directory)
    kubelet.start()
    shim_socket = directory / "cri.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpushare.cli",
            "node",
            "--node-name",
            "n1",
            "--kubeconfig",
            str(kubeconfig),
            "--gpus",
            "sim:2xA100-80GB:81920",
            "--device-plugin-dir",
            str(directory),
            "--enforcement",
            "cri-shim",
            "--listen",
            f"unix://{shim_socket}",
            "--runtime",
            f"unix://{directory / 'no-runtime.sock'}",
            "--metrics-port",
            "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert kubelet.wait_for(lambda k: k.capacity(RESOURCE_MEM) == 160 and k.capacity(RESOURCE_COUNT) == 160, 30)
        wait_until(lambda: NODE_ANN_INVENTORY in (get_node(kube_api, "n1")["metadata"].get("annotations") or {}), 10)
        wait_until(shim_socket.exists, 10, "the CRI shim socket")
        assert (shim_socket.stat().st_mode & 0o777) == 0o600
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read()
        assert not (directory / "gpushare-gpu-mem.sock").exists()
        # the device plugin and the CRI shim both read the node's pods, from one LIST+WATCH
        assert apiserver.reads["pods", "watch", "spec.nodeName=n1"] == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_cri_shim_flags_that_are_not_unix_sockets_are_refused_by_name() -> None:
    for flag, value in (("--listen", "relative.sock"), ("--runtime", "tcp://10.0.0.1:1234")):
        done = subprocess.run(
            [sys.executable, "-m", "gpushare.cli", "cri-shim", "--node-name", "n1", "--gpus", "sim:1xT4:15360",
             "--no-api-fetch", "--metrics-port", "0", flag, value],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2
        assert f"{flag} '{value}': expected an absolute unix socket path" in done.stderr
        assert "Traceback" not in done.stderr


def test_the_node_command_defaults_to_what_its_daemonset_passes() -> None:
    """Run by hand, ``gpushare node`` serves where the DaemonSet's probes and kubelet look; it reads every
    argument the DaemonSet gives it, and only --metrics-host (the pod's IP) and --cgroup-root (the host's
    hierarchy, mounted into the pod) differ from its defaults."""
    manifest = Path(__file__).parents[2] / "deploy" / "node-agent.yaml"
    (daemonset,) = [d for d in yaml.safe_load_all(manifest.read_text()) if d and d["kind"] == "DaemonSet"]
    (agent,) = daemonset["spec"]["template"]["spec"]["containers"]
    passed = build_parser().parse_args(
        [*agent["command"][1:], *(a.replace("$(POD_IP)", "10.1.2.3") for a in agent["args"])]
    )
    defaults = build_parser().parse_args(["node"])
    read = [arg.split("=", 1)[0][2:].replace("-", "_") for arg in agent["args"]]
    assert {name for name in read if getattr(passed, name) != getattr(defaults, name)} == {
        "metrics_host",
        "cgroup_root",
    }
    assert defaults.metrics_port == 9410 != build_parser().parse_args(["cri-shim"]).metrics_port
