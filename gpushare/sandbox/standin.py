"""``gpushare sandbox`` on the stand-ins: the cluster of :mod:`gpushare.sandbox.cluster`, and each example
pod taken through what kube-scheduler and kubelet would do with it: scheduled through the extender,
admitted by the kubelet emulator, and its containers created through the node's CRI shim (or, without
containerd, the env kubelet would pass)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from gpushare.contract.request import requests_gpu
from gpushare.kube.objects import bind_pod, get_pod, patch_pod_status
from gpushare.placement import DEFAULT_POLICY
from gpushare.sandbox.cluster import Sandbox, SandboxError, SimNode
from gpushare.sandbox.examples import EXAMPLES, load_examples, with_string_quantities
from gpushare.sandbox.kubeletemulator import AdmissionResult
from gpushare.sandbox.nodespec import NodeSpec
from gpushare.sandbox.printout import KEEP_RUNNING_HINT, PodOutcome, Progress, RunDir, cards_of, report, stay_up
from gpushare.sandbox.scheduler import ExtenderCallError, ExtenderClient, schedule_one


def submit(sandbox: Sandbox, manifests: Sequence[Mapping[str, Any]]) -> list[PodOutcome]:
    """Create each pod and take it as far as it goes, one at a time."""
    from kubernetes import client

    core = client.CoreV1Api(sandbox.api)
    outcomes = []
    for manifest in manifests:
        body = with_string_quantities(manifest)
        created = core.create_namespaced_pod(manifest["metadata"].get("namespace", "default"), body)
        outcomes.append(_run(sandbox, get_pod(sandbox.api, created.metadata.namespace, created.metadata.name)))
    return outcomes


def _run(sandbox: Sandbox, pod: dict[str, Any]) -> PodOutcome:
    meta = pod["metadata"]
    outcome = PodOutcome(name=meta["name"])
    node = _schedule(sandbox, pod, outcome)
    if node is None:
        return outcome
    outcome.node = node
    pod = get_pod(sandbox.api, meta["namespace"], meta["name"])
    sim = sandbox.nodes[node]
    admission = sim.kubelet.admit(pod)
    if not admission.admitted:
        outcome.state, outcome.reason = "Failed", admission.error
        patch_pod_status(
            sandbox.api,
            meta["namespace"],
            meta["name"],
            {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": admission.error},
        )
        return outcome
    outcome.cards = cards_of(get_pod(sandbox.api, meta["namespace"], meta["name"]), sim.backend.cards())
    _start_containers(sandbox, pod, admission, sim, outcome)
    return outcome


def _schedule(sandbox: Sandbox, pod: dict[str, Any], outcome: PodOutcome) -> str | None:
    node_names = sorted(sandbox.nodes)
    meta = pod["metadata"]
    if not requests_gpu(pod):
        # kube-scheduler calls the extender only for pods that request its managed resources
        node = node_names[0]
        bind_pod(sandbox.api, meta["namespace"], meta["name"], meta.get("uid"), node)
        return node
    try:
        result = schedule_one(ExtenderClient(sandbox.extender_url), pod, node_names)
    except ExtenderCallError as exc:
        outcome.reason = str(exc)
        return None
    if result.node is None:
        outcome.reason = result.reason
        sandbox.events.record(pod, reason="FailedScheduling", message=result.reason, type_="Warning")
        return None
    return result.node


def _start_containers(
    sandbox: Sandbox, pod: dict[str, Any], admission: AdmissionResult, sim: SimNode, outcome: PodOutcome
) -> None:
    from gpushare.sandbox.cri_kubelet import CriRuntime, container_config

    meta = pod["metadata"]
    if sim.cri_address is None:
        for spec in pod["spec"]["containers"]:
            config = container_config(pod, spec, admission.containers.get(spec["name"]), "")
            outcome.env[spec["name"]] = {kv.key: kv.value for kv in config.envs}
        outcome.state, outcome.env_source = "Admitted", "kubelet"
        return
    cri = CriRuntime(sim.cri_address)
    try:
        outcome.env = cri.run_pod(pod, admission.containers, sandbox.test_image)
        outcome.state, outcome.env_source = "Running", "container"
        patch_pod_status(sandbox.api, meta["namespace"], meta["name"], {"phase": "Running"})
    except grpc.RpcError as exc:
        outcome.state, outcome.reason = "CreateContainerError", exc.details() or str(exc.code())
    finally:
        cri.close()


def run_standin(
    specs: Sequence[NodeSpec],
    policy: str,
    containers: bool,
    keep_running: bool,
    out: Any = sys.stdout,
    nvml_fake: Sequence[str] = (),
) -> int:
    policy = policy or DEFAULT_POLICY
    progress = Progress(total=5)
    started = time.monotonic()
    with RunDir() as run_dir:
        sandbox = Sandbox(specs, policy, containers, run_dir.path, nvml_fake)
        run_dir.on_exit(sandbox.stop)
        try:
            sandbox.start(progress)
            with progress.step(
                f"scheduling and starting the example pods from {EXAMPLES.relative_to(EXAMPLES.parents[1])}"
            ):
                outcomes = submit(sandbox, load_examples())
        except SandboxError as exc:
            print(f"gpushare sandbox: {exc}", file=sys.stderr)
            run_dir.failed = True
            return 1
        report(outcomes, policy, started, sandbox.inspect(), sandbox.container_note, out)
        if not keep_running:
            print(f"\n{KEEP_RUNNING_HINT}", file=out)
            return 0
        stay_up(
            f"gpushare inspect --kubeconfig {sandbox.kubeconfig}\n         curl {sandbox.extender_url}/metrics", out
        )
    return 0
