"""The NVML path (``--gpus nvml``) on the fake libnvidia-ml, through the real pynvml binding: the inventory
each machine presents, what the advertiser and the device plugin make of it, and health both ways."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from gpushare.advertiser.agent import Advertiser
from gpushare.deviceplugin.devices import card_of_device, device_id
from gpushare.deviceplugin.plugin import SOCKETS
from gpushare.deviceplugin.wiring import RunningPlugin, start_device_plugin
from kubernetes import client
from podfactory import container, gpu_pod
from support.nvml import described_cards, fake_machine, nvml_backend
from support.waiting import wait_until

from gpushare.contract.inventory import NodeInventory, parse_inventory
from gpushare.contract.names import (
    ANN_GPU_MODEL,
    ANN_MEM_ASSUME_TIME,
    ANN_REQUIRE_NVLINK,
    NODE_ANN_INVENTORY,
    NODE_LABEL_MODEL,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.units import GIB
from gpushare.gpus.backend import HealthEvent, InventoryError, parse_ignored_xids
from gpushare.gpus.nvml import NvmlBackend, _single_node
from gpushare.kube.objects import get_node
from gpushare.pb import deviceplugin_pb2 as pb
from gpushare.pb import deviceplugin_pb2_grpc as pb_grpc
from gpushare.sandbox import fakenvml
from gpushare.sandbox.fakenvml import FakeNvml
from gpushare.sandbox.kubeletemulator import KubeletEmulator
from gpushare.settings import NodeSettings

FAST = {"poll_interval": 0.05}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="nvml", dir="/tmp"))  # unix socket paths must stay short
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def published_inventory(api: client.ApiClient, node: str) -> NodeInventory | None:
    text = (get_node(api, node)["metadata"].get("annotations") or {}).get(NODE_ANN_INVENTORY)
    return parse_inventory(text, node) if text else None


def annotated_health(api: client.ApiClient, node: str, index: int) -> bool | None:
    inventory = published_inventory(api, node)
    return None if inventory is None else inventory.cards[index].healthy


# --- what each machine presents ----------------------------------------------------------------------------


def test_dgx_a100_inventory_is_what_nvml_describes(tmp_path, monkeypatch, kube_api, core_v1) -> None:
    described = described_cards("dgx-a100")
    with nvml_backend("dgx-a100", tmp_path, monkeypatch, **FAST) as (backend, _):
        cards = backend.cards()
        core_v1.create_node({"metadata": {"name": "dgx"}})
        Advertiser(kube_api, "dgx", backend, GIB).publish_once()
    assert [(card.index, card.uuid, card.model, card.memory_mib, card.minor) for card in cards] == [
        (i, d["uuid"], d["name"], int(d["memory-mib"]), int(d["minor"])) for i, d in enumerate(described)
    ]
    assert any(card.minor != card.index for card in cards)
    assert [card.numa_node for card in cards] == [0, 0, 0, 0, 1, 1, 1, 1]
    uuids = {card.uuid for card in cards}
    for card in cards:  # every A100 reaches every other through the NVSwitch fabric
        assert set(card.nvlink_peers) == uuids - {card.uuid}
    assert all(card.healthy for card in cards)

    inventory = published_inventory(kube_api, "dgx")
    assert inventory is not None and inventory.cards == tuple(cards)
    assert [inventory.units_of(card) for card in cards] == [80] * 8
    labels = core_v1.read_node("dgx").metadata.labels
    assert labels[NODE_LABEL_MODEL] == "NVIDIA-A100-SXM4-80GB"


def test_mixed_node_t4_has_no_nvlink_and_only_bridged_a100s_are_peers(tmp_path, monkeypatch) -> None:
    with nvml_backend("mixed", tmp_path, monkeypatch, **FAST) as (backend, _):
        a0, a1, t4, a3 = backend.cards()
    assert (t4.model, t4.memory_mib, t4.nvlink_peers) == ("Tesla T4", 15360, ())
    assert a0.nvlink_peers == (a1.uuid,) and a1.nvlink_peers == (a0.uuid,)
    assert a3.nvlink_peers == ()  # an A100 without a bridge
    assert [card.numa_node for card in (a0, a1, t4, a3)] == [0, 0, 1, 1]


def test_a_mig_mode_card_is_left_out_by_name(tmp_path, monkeypatch, caplog) -> None:
    whole, mig = described_cards("mig")
    caplog.set_level(logging.WARNING, logger="gpushare.gpus")
    with nvml_backend("mig", tmp_path, monkeypatch, **FAST) as (backend, _):
        cards = backend.cards()
    assert [(card.index, card.uuid) for card in cards] == [(0, whole["uuid"])]
    assert cards[0].nvlink_peers == ()  # its only peer is the MIG card, which is not on offer
    [message] = [r.getMessage() for r in caplog.records if mig["uuid"] in r.getMessage()]
    assert "MIG mode" in message and "NVML index 1" in message and "not advertised" in message


def test_a_card_lost_before_start_is_left_out_naming_the_call(tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="gpushare.gpus")
    with nvml_backend("lost-card", tmp_path, monkeypatch, **FAST) as (backend, _):
        cards = backend.cards()
    assert [card.index for card in cards] == [0, 2]  # indices stay NVML's
    assert all(card.healthy and card.numa_node is None for card in cards)
    assert "card at NVML index 1: nvmlDeviceGetHandleByIndex failed: GPU is lost; not advertised" in caplog.messages


def test_faults_at_start_name_the_card_and_the_call(tmp_path, monkeypatch, caplog) -> None:
    ok, no_events, unreadable = (d["uuid"] for d in described_cards("faulty"))
    caplog.set_level(logging.WARNING, logger="gpushare.gpus")
    with nvml_backend("faulty", tmp_path, monkeypatch, **FAST) as (backend, _):
        cards = backend.cards()
    # a card that can't report XIDs is not trusted with work; one that can't be read is not offered
    assert [(card.uuid, card.healthy) for card in cards] == [(ok, True), (no_events, False)]
    assert (
        f"card {unreadable} (NVML index 2): nvmlDeviceGetMemoryInfo failed: Unknown Error; not advertised"
        in caplog.messages
    )
    assert (
        f"card {no_events} (index 1) is now Unhealthy: nvmlDeviceRegisterEvents failed: Not Supported: "
        "its XID events can't be watched" in caplog.messages
    )
    assert (
        f"cards {ok} and {no_events}: nvmlDeviceGetP2PStatus failed: Unknown Error; taken as not NVLink-connected"
        in caplog.messages
    )


def test_driver_not_loaded_is_one_error_naming_the_call(tmp_path, monkeypatch) -> None:
    error = r"nvmlInit failed: Driver Not Loaded\. On a GPU node"
    with pytest.raises(InventoryError, match=error), nvml_backend("no-driver", tmp_path, monkeypatch):
        pass


# --- a library with its machine built in ---------------------------------------------------------------------

#: a fresh process's inventory through pynvml: the UUIDs of its cards, as JSON
CHILD_INVENTORY = (
    "import json; from gpushare.gpus.nvml import NvmlBackend; backend = NvmlBackend(); "
    "print(json.dumps([card.uuid for card in backend.cards()])); backend.close()"
)


def uuids_in_a_child(library: Path, env: dict[str, str]) -> list[str]:
    """The cards a process sees that finds ``library`` first and has no fake-NVML variable but ``env``'s."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_FAKE_NVML_")}
    child_env.update(env, LD_LIBRARY_PATH=str(library.parent))
    done = subprocess.run(
        [sys.executable, "-c", CHILD_INVENTORY], env=child_env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def dgx_built_in() -> Path:
    if reason := fakenvml.gcc_missing():
        pytest.skip(f"the fake libnvidia-ml can't be built: {reason}")
    return fakenvml.build_with_machine("dgx-a100")


def test_a_library_with_its_machine_built_in_needs_no_environment(dgx_built_in: Path) -> None:
    """As in a pod that mounts only the library file: no machine file, no variable naming one."""
    assert uuids_in_a_child(dgx_built_in, {}) == [card["uuid"] for card in described_cards("dgx-a100")]


def test_the_environment_overrides_the_built_in_machine(dgx_built_in: Path) -> None:
    env = {fakenvml.ENV_MACHINE: str(fakenvml.machine_file("mixed"))}
    assert uuids_in_a_child(dgx_built_in, env) == [card["uuid"] for card in described_cards("mixed")]


def test_memory_affinity_masks() -> None:
    assert _single_node([0b10, 0]) == 1
    assert _single_node([0, 1 << 6]) == 70
    assert _single_node([0b11, 0]) is None  # no single node to prefer
    assert _single_node([0, 0]) is None


def node_agent(kubeconfig: Path, directory: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpushare.cli", "node", "--node-name", "n1", "--kubeconfig", str(kubeconfig),
         "--gpus", "nvml", "--device-plugin-dir", str(directory), "--no-cri-shim", "--metrics-port", "0"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def test_driver_not_loaded_refuses_to_start_with_the_reason(tmp_path, kubeconfig) -> None:
    fake = fake_machine("no-driver", tmp_path)
    proc = node_agent(kubeconfig, tmp_path, fake.env())
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last.startswith("gpushare node: NVML could not be initialised: nvmlInit failed: Driver Not Loaded")
    assert "Traceback" not in stderr


# --- the device plugin and kubelet ----------------------------------------------------------------------


def card_health(devices: dict[str, str]) -> dict[str, str]:
    """Each card's health as kubelet sees it through its gpu-count replicas ("mixed" if they disagree)."""
    states: dict[str, set[str]] = {}
    for listed, health in devices.items():
        states.setdefault(card_of_device(listed), set()).add(health)
    return {card: next(iter(s)) if len(s) == 1 else "mixed" for card, s in states.items()}


class NvmlNode:
    """The NVML backend on a fake machine, the device plugin and the kubelet emulator, in this process."""

    def __init__(self, backend: NvmlBackend, fake: FakeNvml, api: client.ApiClient, directory: Path) -> None:
        self.backend, self.fake, self.dir = backend, fake, directory
        self.kubelet = KubeletEmulator(directory)
        self.kubelet.start()
        settings = NodeSettings("n1", None, "nvml", directory, GIB, frozenset())
        self.running: RunningPlugin = start_device_plugin(settings, backend, api)
        assert self.kubelet.wait_registered(RESOURCE_MEM, 10) and self.kubelet.wait_registered(RESOURCE_COUNT, 10)
        assert self.running.cache.wait_synced(10)

    def stub(self, resource: str) -> pb_grpc.DevicePluginStub:
        return pb_grpc.DevicePluginStub(grpc.insecure_channel(f"unix://{self.dir / SOCKETS[resource]}"))

    def offered(self, cards: list[str], size: int) -> list[str]:
        """The device IDs GetPreferredAllocation answers when kubelet offers three gpu-count replicas of
        each card."""
        available = [device_id(uuid, n) for uuid in cards for n in range(3)]
        reply = self.stub(RESOURCE_COUNT).GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=size)
                ]
            ),
            timeout=10,
        )
        return list(reply.container_responses[0].deviceIDs)

    def preferred(self, cards: list[str], size: int) -> set[str]:
        """The cards GetPreferredAllocation picks when kubelet offers three gpu-count replicas of each."""
        chosen = [card_of_device(d) for d in self.offered(cards, size)]
        assert len(chosen) == len(set(chosen)) == size, f"not {size} distinct cards: {chosen}"
        return set(chosen)

    def health(self, uuid: str) -> str:
        return card_health(self.kubelet.devices(RESOURCE_COUNT)).get(uuid, "absent")

    def stop(self) -> None:
        self.running.stop()
        self.kubelet.stop()


@pytest.fixture
def dgx(tmp_path, monkeypatch, kube_api, core_v1, short_dir) -> Iterator[NvmlNode]:
    core_v1.create_node({"metadata": {"name": "n1"}})
    with nvml_backend("dgx-a100", tmp_path, monkeypatch, recovery_after=1.0, **FAST) as (backend, fake):
        node = NvmlNode(backend, fake, kube_api, short_dir)
        yield node
        node.stop()


def test_list_and_watch_lists_every_dgx_card_with_its_numa_node(dgx: NvmlNode) -> None:
    cards = dgx.backend.cards()
    assert card_health(dgx.kubelet.devices(RESOURCE_COUNT)) == {card.uuid: "Healthy" for card in cards}
    assert dgx.kubelet.capacity(RESOURCE_MEM) == dgx.kubelet.capacity(RESOURCE_COUNT) == 8 * 80
    first = next(iter(dgx.stub(RESOURCE_COUNT).ListAndWatch(pb.Empty(), timeout=10)))
    numa = {(card_of_device(d.ID), n.ID) for d in first.devices for n in d.topology.nodes}
    assert numa == {(card.uuid, card.numa_node) for card in cards}


def test_preferred_allocation_on_the_dgx_keeps_a_group_on_one_numa_node(dgx: NvmlNode) -> None:
    uuids = [card.uuid for card in dgx.backend.cards()]
    four = dgx.preferred(uuids, 4)
    assert four in ({*uuids[:4]}, {*uuids[4:]})
    # cards 2 and 3 taken: three cards fit together only on NUMA node 1
    available = [uuids[0], uuids[1], uuids[4], uuids[5], uuids[6]]
    assert dgx.preferred(available, 3) == {uuids[4], uuids[5], uuids[6]}
    pair = dgx.preferred([uuids[0], uuids[4], uuids[5]], 2)
    assert pair == {uuids[4], uuids[5]}


@pytest.fixture
def mixed(tmp_path, monkeypatch, kube_api, core_v1, short_dir) -> Iterator[NvmlNode]:
    core_v1.create_node({"metadata": {"name": "n1"}})
    with nvml_backend("mixed", tmp_path, monkeypatch, **FAST) as (backend, fake):
        node = NvmlNode(backend, fake, kube_api, short_dir)
        yield node
        node.stop()


def test_preferred_allocation_on_the_mixed_node_follows_the_nvlink_bridge(mixed: NvmlNode) -> None:
    a0, a1, t4, a3 = (card.uuid for card in mixed.backend.cards())
    assert mixed.preferred([a0, t4, a3, a1], 2) == {a0, a1}  # the bridged pair, across from NUMA 1
    assert mixed.preferred([a1, t4, a3], 2) == {t4, a3}  # no bridge left: one NUMA node


def test_preferred_allocation_keeps_the_matched_pods_card_rule(mixed: NvmlNode, core_v1) -> None:
    a0, a1, t4, a3 = (card.uuid for card in mixed.backend.cards())
    offer = [a1, t4, a3]
    assert mixed.preferred(offer, 2) == {t4, a3}  # no pod to match: one NUMA node
    # a placed pod whose cards the plugin must pick itself (none recorded), A100s only
    marked = {ANN_MEM_ASSUME_TIME: "1", ANN_GPU_MODEL: "A100"}
    core_v1.create_namespaced_pod("default", gpu_pod("picky", [container("main", 0, 2)], extra_annotations=marked))
    wait_until(lambda: mixed.preferred(offer, 2) == {a1, a3}, what="the A100 pair for the A100-only pod")
    # NVLink required too: no bridged pair is offered, so no set at all rather than a wrong one
    core_v1.patch_namespaced_pod("picky", "default", {"metadata": {"annotations": {ANN_REQUIRE_NVLINK: "true"}}})
    wait_until(lambda: mixed.offered(offer, 2) == [], what="no set for the NVLink pod")
    assert {card_of_device(d) for d in mixed.offered([a0, t4, a3, a1], 2)} == {a0, a1}


def test_xids_reach_kubelet_and_the_card_recovers(dgx: NvmlNode, kube_api) -> None:
    fake = dgx.fake
    advertiser = Advertiser(kube_api, "n1", dgx.backend, GIB)
    advertiser.start()
    seen: list[HealthEvent] = []
    dgx.backend.subscribe(seen.append)
    cards = dgx.backend.cards()
    try:
        for xid in (13, 31, 43):  # the application's fault, not the card's
            fake.xid(cards[0].uuid, xid)
        fake.xid(cards[1].uuid, 48)
        failed = time.monotonic()
        # events are handled in order: by the time card 1 flips, card 0's XIDs have been judged
        # both resources' device lists carry the flip (they are separate streams)
        assert dgx.kubelet.wait_for(
            lambda k: dgx.health(cards[1].uuid) == "Unhealthy" and k.allocatable(RESOURCE_MEM) == 7 * 80, 10
        )
        assert dgx.health(cards[0].uuid) == "Healthy" and dgx.kubelet.allocatable(RESOURCE_COUNT) == 7 * 80
        wait_until(lambda: annotated_health(kube_api, "n1", 1) is False, 10, "card 1 unhealthy in the annotation")
        # back, after the recovery time without a further fault
        assert dgx.kubelet.wait_for(
            lambda k: dgx.health(cards[1].uuid) == "Healthy" and k.allocatable(RESOURCE_MEM) == 8 * 80, 10
        )
        assert time.monotonic() - failed >= 1.0
        wait_until(lambda: annotated_health(kube_api, "n1", 1), 10, "card 1 healthy again in the annotation")
        wait_until(lambda: len(seen) == 2, 5, "both health events")
        assert [(e.uuid, e.healthy, e.reason.split(" for")[0]) for e in seen] == [
            (cards[1].uuid, False, "XID 48"),
            (cards[1].uuid, True, "no fault"),
        ]
    finally:
        advertiser.stop()


def test_a_card_that_falls_off_the_bus_turns_unhealthy_and_back(dgx: NvmlNode) -> None:
    fake = dgx.fake
    seen: list[HealthEvent] = []
    dgx.backend.subscribe(seen.append)
    lost = dgx.backend.cards()[5].uuid
    fake.lose(lost)
    assert dgx.kubelet.wait_for(lambda k: dgx.health(lost) == "Unhealthy", 10)
    wait_until(lambda: seen, 5, "the health event")  # kubelet may hear of it before this subscriber does
    assert (seen[0].uuid, seen[0].reason) == (lost, "nvmlDeviceGetMemoryInfo failed: GPU is lost")
    fake.restore(lost)
    assert dgx.kubelet.wait_for(lambda k: dgx.health(lost) == "Healthy", 10)
    assert sum(1 for card in dgx.backend.cards() if card.healthy) == 8


def test_ignore_xids_is_honoured(tmp_path, monkeypatch) -> None:
    ignored = parse_ignored_xids("79")
    with nvml_backend("mixed", tmp_path, monkeypatch, ignored_xids=ignored, **FAST) as (backend, fake):
        seen: list[HealthEvent] = []
        backend.subscribe(seen.append)
        a0, a1, *_ = backend.cards()
        fake.xid(a0.uuid, 79)  # critical by default, ignored here
        fake.xid(a1.uuid, 13)  # ignored by default, critical here
        wait_until(lambda: seen, 10, "a health event")
        assert [(e.uuid, e.healthy, e.reason) for e in seen] == [(a1.uuid, False, "XID 13")]
        assert [card.healthy for card in backend.cards()] == [True, False, True, True]


def test_node_agent_runs_on_the_fake_library(tmp_path, kubeconfig, kube_api, core_v1, short_dir) -> None:
    """``gpushare node --gpus nvml`` as a node runs it: libnvidia-ml found on LD_LIBRARY_PATH."""
    fake = fake_machine("mixed", tmp_path)
    core_v1.create_node({"metadata": {"name": "n1"}})
    kubelet = KubeletEmulator(short_dir)
    kubelet.start()
    proc = node_agent(kubeconfig, short_dir, fake.env())
    try:
        # both resources register on their own streams: wait for both device lists
        assert kubelet.wait_for(
            lambda k: k.capacity(RESOURCE_COUNT) == k.capacity(RESOURCE_MEM) == 40 + 40 + 15 + 40, 30
        ), "the agent did not register both resources"
        described = [d["uuid"] for d in described_cards("mixed")]
        assert set(card_health(kubelet.devices(RESOURCE_COUNT))) == set(described)
        inventory = wait_until(lambda: published_inventory(kube_api, "n1"), 10, "the inventory annotation")
        assert [card.uuid for card in inventory.cards] == described
        fake.xid(described[2], 79)
        assert kubelet.wait_for(lambda k: card_health(k.devices(RESOURCE_COUNT))[described[2]] == "Unhealthy", 10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        kubelet.stop()


def test_sandbox_runs_the_examples_on_a_fake_nvml_node(tmp_path) -> None:
    fake_machine("mixed", tmp_path)  # skips without gcc
    proc = subprocess.run(
        [sys.executable, "-m", "gpushare.cli", "sandbox", "--nvml-fake", "mixed", "--no-containers"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = next(line for line in proc.stdout.splitlines() if line.startswith("shared-1 "))
    assert "nvml-mixed" in shared and "Admitted" in shared
    assert "Total:      135 GiB" in proc.stdout  # 3 x 40 GiB A100 + 15 GiB T4, as NVML reported them
