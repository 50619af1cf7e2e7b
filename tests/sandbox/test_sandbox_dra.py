"""``gpushare sandbox --dra-cards``: a claim of deploy/examples/dra, applied with kubectl as docs/dra.md
says, runs on the card its node's agent offers through DRA, while the node's other cards stay with the
device plugin and the extender."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support.sandboxrun import SandboxRun, kept_running, kubeconfig
from support.waiting import wait_until

from gpushare.contract.dra import format_device_name
from gpushare.contract.inventory import parse_inventory
from gpushare.contract.names import DRA_DRIVER, NODE_ANN_INVENTORY
from gpushare.kube.objects import get_pod
from gpushare.kube.transport import load_api
from gpushare.sandbox import binaries
from gpushare.sandbox.realcluster import realcluster_available

pytestmark = pytest.mark.skipif(
    realcluster_available() is not None, reason=f"no real cluster here: {realcluster_available()}"
)
EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "dra" / "memory-8gi.yaml"
#: node-a (2xA100-80GB, 1xT4) offers its card 0 through DRA; cards 1 and 2 stay with the device plugin
DRA_NODE, DRA_CARD = "node-a", 0


@pytest.fixture(scope="module")
def kept() -> Iterator[SandboxRun]:
    with kept_running("--dra-cards", f"{DRA_NODE}={DRA_CARD}") as run:
        yield run


def test_the_dra_example_claim_runs_on_the_card_its_node_offers(kept: SandboxRun) -> None:
    config = kubeconfig(kept)
    done = subprocess.run(
        [str(binaries.built("kubectl")), "--kubeconfig", config, "apply", "-f", str(EXAMPLE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    api = load_api(config)

    def running() -> dict[str, Any] | None:
        pod = get_pod(api, "default", "dra-memory-8gi")
        return pod if (pod.get("status") or {}).get("phase") == "Running" else None

    pod = wait_until(running, 120, "pod dra-memory-8gi to run", 0.5)
    assert pod["spec"]["nodeName"] == DRA_NODE
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = client.ResourceV1Api(api).read_namespaced_resource_claim(status["resourceClaimName"], "default")
    (result,) = claim.status.allocation.devices.results
    assert (result.driver, result.pool, result.device) == (DRA_DRIVER, DRA_NODE, format_device_name(DRA_CARD))
    # the device plugin's side of the node lists only the cards DRA doesn't have
    annotations = client.CoreV1Api(api).read_node(DRA_NODE).metadata.annotations or {}
    assert [c.index for c in parse_inventory(annotations[NODE_ANN_INVENTORY], DRA_NODE).cards] == [1, 2]


def test_the_example_pods_still_run_on_the_device_plugins_cards(kept: SandboxRun) -> None:
    for pod in ("shared-1", "shared-2", "multi-container", "two-cards"):
        # the pod's first row: the outcome table, above the environment's
        row = next(line for line in kept.out.text.splitlines() if line.startswith(f"{pod} "))
        assert "Running" in row, row
