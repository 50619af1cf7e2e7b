"""Alibaba's scheduler extender (github.com/AliyunContainerService/gpushare-scheduler-extender) in the
nodeless benchmarks: built from a checkout the user names, started against the benchmark cluster, and
wired into kube-scheduler as its ``config/scheduler-policy-config.yaml`` wires it.

Neither its source nor a binary is kept here: the Go module proxy doesn't serve it, so the user brings a
checkout and the Go toolchain on PATH builds it into a temporary directory.

Its client rate limit. ``cmd/main.go`` (``initKubeClient``) builds its client from
``clientcmd.BuildConfigFromFlags`` and leaves ``rest.Config``'s ``QPS`` and ``Burst`` unset, so client-go's
defaults apply: 5 requests/s, bursts of 10 (``DefaultQPS``/``DefaultBurst``, k8s.io/client-go
``rest/config.go``). No flag or environment variable sets them, and Go's ``-ldflags -X`` sets only string
variables. Each bind costs it two writes (a patch of the pod with the card, then the binding:
``pkg/cache/nodeinfo.go``, ``Allocate``), so as shipped it binds at most 2.5 pods/s once the burst is
spent, whatever the scheduler can do. For a fair run the build lifts it to the rate kube-scheduler gets:
``go build -overlay`` swaps, for that build only, ``cmd/main.go`` for a copy with one line added before
the clientset is made (``restConfig.QPS, restConfig.Burst = QPS, BURST``); the checkout is only read.
:func:`build` prints that change as a diff.

Its configuration is its environment (``cmd/main.go``): ``KUBECONFIG``, ``PORT``, ``LOG_LEVEL`` (unset
here: its default, which still writes several ``info`` lines per node a filter looks at) and
``THREADNESS`` (unset: one worker per CPU). Its log goes to stdout, which is discarded: the lines are
formatted as deployed, but not written to this machine's disk (its stderr, where Go's panics go, stays in
its log file; a start-up failure it logs as fatal does not). The nodes carry ``aliyun.com/gpu-count``
as Alibaba's device plugin reports it, the number of cards (``patchGPUCount`` in
github.com/AliyunContainerService/gpushare-device-plugin): the extender takes each card to hold
``gpu-mem / gpu-count`` (``pkg/cache/nodeinfo.go``, ``NewNodeInfo``).
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client

from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM
from gpushare.gpus.simulated import simulated_cards
from gpushare.sandbox.controlplane import EXTENDER_USER
from gpushare.sandbox.launch import ClusterError, Process, free_port, http_status, wait_for
from gpushare.sandbox.realcluster import RealCluster

#: the line of cmd/main.go the rate limit is set before: where its client is made from its rest.Config
CLIENT_LINE = "clientset, err = kubernetes.NewForConfig(restConfig)"
#: where its routes live (pkg/routes/routes.go)
API_PREFIX = "/gpushare-scheduler"


def build(src: Path, out: Path, qps: float) -> Path:
    """The extender from the checkout ``src``, its client allowed ``qps`` requests/s (burst the same),
    built into ``out``; prints the change made for the build. ClusterError when it can't be built."""
    go = shutil.which("go")
    if go is None:
        raise ClusterError("--aliyun-src needs the Go toolchain on PATH")
    main = (src / "cmd" / "main.go").resolve()
    try:
        original = main.read_text()
    except OSError as exc:
        raise ClusterError(f"--aliyun-src {src}: {exc}") from None
    if original.count(CLIENT_LINE) != 1:
        raise ClusterError(f"{main}: no single line {CLIENT_LINE!r} to lift the client rate limit before")
    lifted = original.replace(CLIENT_LINE, f"restConfig.QPS, restConfig.Burst = {qps:g}, {int(qps)}\n\t{CLIENT_LINE}")
    patched = out / "main.go"
    patched.write_text(lifted)
    overlay = out / "overlay.json"
    overlay.write_text(json.dumps({"Replace": {str(main): str(patched)}}))
    binary = out / "gpushare-scheduler-extender"
    diff = difflib.unified_diff(
        original.splitlines(), lifted.splitlines(), "cmd/main.go", "cmd/main.go (this build)", lineterm=""
    )
    print("Alibaba's extender, built with its client rate limit lifted:", *diff, sep="\n", flush=True)
    done = subprocess.run(
        [go, "build", f"-overlay={overlay}", "-o", str(binary), "./cmd"],
        cwd=src,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ClusterError(f"go build in {src} failed:\n{done.stderr.strip()}")
    return binary


def count_cards(core: client.CoreV1Api, pool: ThreadPoolExecutor, nodes: Sequence[tuple[str, str]]) -> None:
    """Each node's ``aliyun.com/gpu-count`` as Alibaba's device plugin reports it: its cards."""

    def patch(spec: tuple[str, str]) -> None:
        cards = str(len(simulated_cards(*spec)))
        status = {"capacity": {RESOURCE_COUNT: cards}, "allocatable": {RESOURCE_COUNT: cards}}
        core.patch_node_status(spec[0], {"status": status})

    list(pool.map(patch, nodes))


def start(cluster: RealCluster, name: str, binary: Path, wrapper: Sequence[str] = ()) -> tuple[Process, str]:
    """The extender watching the cluster, once it serves, and its URL; ``wrapper`` runs it (``taskset``)."""
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig_of(EXTENDER_USER)), "PORT": str(port)}
    env.pop("LOG_LEVEL", None)
    process = Process(
        name, [*wrapper, "sh", "-c", 'exec "$0" >/dev/null', str(binary)], cluster.workdir / f"{name}.log", env
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        # it serves only once its node, pod and ConfigMap caches have synced (pkg/gpushare/controller.go)
        wait_for(lambda: process.check() or http_status(f"{url}/version") == 200, 300, f"{name} to serve")
    except BaseException:
        process.stop()
        raise
    return process, url


def extender_entry(url: str) -> dict[str, Any]:
    """Its ``extenders`` entry: ``config/scheduler-policy-config.yaml`` in its repository, in
    ``kubescheduler.config.k8s.io/v1``, with ``url`` for the Service it points at."""
    return {
        "urlPrefix": f"{url}{API_PREFIX}",
        "filterVerb": "filter",
        "bindVerb": "bind",
        "enableHTTPS": False,
        "nodeCacheCapable": True,
        "managedResources": [{"name": RESOURCE_MEM, "ignoredByScheduler": False}],
        "ignorable": False,
    }
