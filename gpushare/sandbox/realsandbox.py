"""``gpushare sandbox`` on a real Kubernetes: the cluster of :mod:`gpushare.sandbox.realcluster` with the
pods of deploy/examples applied as a user would, then the same report as the stand-in sandbox, with
every container's GPU environment read from its running process."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpushare.inspection.render import render_details
from gpushare.inspection.views import build_cluster
from gpushare.kube.objects import get_pod, list_nodes, list_pods
from gpushare.placement import DEFAULT_POLICY
from gpushare.sandbox import binaries
from gpushare.sandbox.examples import EXAMPLES, load_examples
from gpushare.sandbox.launch import ClusterError, wait_for
from gpushare.sandbox.nodespec import NodeSpec
from gpushare.sandbox.printout import (
    KEEP_RUNNING_HINT,
    PodOutcome,
    Progress,
    RunDir,
    cards_of,
    render_endpoints,
    report,
    stay_up,
)
from gpushare.sandbox.realcluster import RealCluster, as_sandbox_pod
from gpushare.sandbox.realnode import NVML_PREFIX

#: the DeviceClass of gpushare's DRA driver, which ``--dra-cards`` applies
DEVICE_CLASS = EXAMPLES.parent / "dra" / "deviceclass.yaml"
#: how long an example pod may take to reach a final answer (Running, Failed or Unschedulable)
SETTLE_SECONDS = 60.0


def settled(pod: Mapping[str, Any]) -> PodOutcome | None:
    """What the report says about a pod once its fate is known, else None."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    outcome = PodOutcome(name=meta["name"], node=spec.get("nodeName") or "", state=status.get("phase", "Pending"))
    if outcome.state in ("Running", "Failed", "Succeeded"):
        outcome.reason = status.get("message") or ""
        return outcome
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
            outcome.reason = cond.get("message") or ""
            return outcome
    return None


def apply_examples(cluster: RealCluster, manifests: Sequence[Mapping[str, Any]]) -> list[PodOutcome]:
    from kubernetes import client

    core = client.CoreV1Api(cluster.api)
    names = []
    for manifest in manifests:
        body = as_sandbox_pod(manifest)
        core.create_namespaced_pod(body["metadata"].get("namespace", "default"), body)
        names.append((body["metadata"].get("namespace", "default"), body["metadata"]["name"]))
    outcomes = []
    for namespace, name in names:
        try:
            outcome = wait_for(lambda ns=namespace, n=name: settled(get_pod(cluster.api, ns, n)), SETTLE_SECONDS, name)
        except ClusterError:
            outcome = PodOutcome(name=name, reason=f"no decision within {SETTLE_SECONDS:.0f}s")
        if outcome.state == "Running":
            pod = get_pod(cluster.api, namespace, name)
            outcome.cards = cards_of(pod, cluster.node_inventory(outcome.node).cards)
            outcome.env = {
                spec["name"]: cluster.container_env(outcome.node, namespace, name, spec["name"])
                for spec in pod["spec"]["containers"]
            }
            outcome.env_source = "container"
            outcome.limits = {
                spec["name"]: cluster.memory_limits(outcome.node, namespace, name, spec["name"])
                for spec in pod["spec"]["containers"]
            }
        outcomes.append(outcome)
    return outcomes


def apply_device_class(cluster: RealCluster) -> None:
    """deploy/dra/deviceclass.yaml, as an operator applies it: claims naming gpu.gpushare.io can then be
    allocated from the ResourceSlices of the nodes whose agents serve the DRA driver."""
    import yaml
    from kubernetes import utils

    utils.create_from_dict(cluster.api, yaml.safe_load(DEVICE_CLASS.read_text()))


def run_real(
    specs: Sequence[NodeSpec],
    policy: str,
    keep_running: bool,
    out: Any = sys.stdout,
    nvml_fake: Sequence[str] = (),
    dra_nodes: Mapping[str, str] | None = None,
) -> int:
    """``nvml_fake``: machines for nodes whose agent runs ``--gpus nvml`` on the fake libnvidia-ml;
    ``dra_nodes``: per node whose agent also serves the DRA driver, its ``--dra-cards``."""
    policy = policy or DEFAULT_POLICY
    nodes = [(s.name, s.gpus) for s in specs]
    nodes += [(f"nvml-{Path(machine).stem}", f"{NVML_PREFIX}{machine}") for machine in nvml_fake]
    progress = Progress(total=4)
    started = time.monotonic()
    with RunDir() as run_dir:
        try:
            cluster = RealCluster(nodes, run_dir.path, policy=policy, dra_nodes=dict(dra_nodes or {}))
            run_dir.on_exit(cluster.stop)
            cluster.start(progress.step)
            if dra_nodes:
                apply_device_class(cluster)
            with progress.step(f"applying the example pods from {EXAMPLES.relative_to(EXAMPLES.parents[1])}"):
                outcomes = apply_examples(cluster, load_examples())
        except ClusterError as exc:
            print(f"gpushare sandbox: {exc}", file=sys.stderr)
            run_dir.failed = True
            return 1
        inspect = render_details(build_cluster(list_nodes(cluster.api), list_pods(cluster.api)))
        report(outcomes, policy, started, inspect, "env read with CRI ExecSync from each running container", out)
        if not keep_running:
            print(f"\n{KEEP_RUNNING_HINT}", file=out)
            return 0
        print(f"\nComponent logs: {run_dir.path}\n\nEndpoints\n\n{render_endpoints(cluster.endpoints())}", file=out)
        stay_up(
            f"{binaries.command(binaries.KUBECTL)} --kubeconfig {cluster.kubeconfig} get pods -o wide\n"
            f"         gpushare inspect --kubeconfig {cluster.kubeconfig}",
            out,
        )
    return 0
