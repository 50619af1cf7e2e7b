"""The kubelet plugin as kubelet meets it: real gRPC over unix sockets, a client playing kubelet, and
claims from a stand-in for the API server."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from gpushare.draplugin.server import DraPlugin, DraService, PluginPaths
from support.draclaims import CARDS, NODE, REF, claim, result

from gpushare.contract.resourceclaim import ClaimRef
from gpushare.kube.errors import KubeNotFound
from gpushare.pb import dra_pb2 as pb
from gpushare.pb import dra_pb2_grpc as pb_grpc
from gpushare.pb import pluginregistration_pb2 as reg_pb
from gpushare.pb import pluginregistration_pb2_grpc as reg_grpc


class Claims:
    """The API server's ResourceClaims, by namespace/name."""

    def __init__(self) -> None:
        self.stored: dict[tuple[str, str], dict[str, Any]] = {}

    def __call__(self, ref: ClaimRef) -> dict[str, Any]:
        try:
            return self.stored[(ref.namespace, ref.name)]
        except KeyError:
            raise KubeNotFound(f"ResourceClaim {ref.namespace}/{ref.name}: not found") from None


@pytest.fixture
def root() -> Iterator[Path]:
    # short: a unix socket path must stay under 108 bytes
    path = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def claims() -> Claims:
    return Claims()


@pytest.fixture
def plugin(root: Path, claims: Claims) -> Iterator[DraPlugin]:
    paths = PluginPaths(kubelet_root=root / "kubelet", cdi_dir=root / "cdi")
    running = DraPlugin(paths, DraService(NODE, lambda: CARDS, 1024, claims, paths.cdi_dir))
    running.start()
    yield running
    running.stop()


def kubelet_dra(plugin: DraPlugin) -> Iterator[pb_grpc.DRAPluginStub]:
    """Dial the DRA service the way kubelet does: at the endpoint the registration service named."""
    with grpc.insecure_channel(f"unix://{plugin.paths.registration_socket}") as channel:
        info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=5)
    with grpc.insecure_channel(f"unix:{info.endpoint}") as channel:
        yield pb_grpc.DRAPluginStub(channel)


@pytest.fixture
def dra(plugin: DraPlugin) -> Iterator[pb_grpc.DRAPluginStub]:
    yield from kubelet_dra(plugin)


def wire(ref: ClaimRef) -> pb.Claim:
    return pb.Claim(namespace=ref.namespace, name=ref.name, uid=ref.uid)


def test_registration_names_the_driver_and_its_dra_socket(plugin: DraPlugin) -> None:
    assert plugin.paths.registration_socket.name == "gpu.gpushare.io-reg.sock"
    with grpc.insecure_channel(f"unix://{plugin.paths.registration_socket}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
        assert (info.type, info.name, list(info.supported_versions)) == (
            "DRAPlugin",
            "gpu.gpushare.io",
            ["v1.DRAPlugin"],
        )
        assert info.endpoint == str(plugin.paths.kubelet_root / "plugins" / "gpu.gpushare.io" / "dra.sock")
        assert not plugin.registration.registered.is_set()
        stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        assert plugin.registration.registered.is_set()


def test_prepare_writes_the_claims_cdi_spec_and_answers_its_device(
    plugin: DraPlugin, dra: pb_grpc.DRAPluginStub, claims: Claims
) -> None:
    claims.stored[(REF.namespace, REF.name)] = claim(result(device="card-1", memory="8Gi"))
    for _ in range(2):  # kubelet may ask again (after its restart): same answer
        reply = dra.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=[wire(REF)]), timeout=5)
        got = reply.claims[REF.uid]
        assert got.error == ""
        assert [
            (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids), d.share_id) for d in got.devices
        ] == [
            (["gpu"], NODE, "card-1", [f"gpu.gpushare.io/claim={REF.uid}-gpu"], "dcd38910-fed2-4b80-8171-4063a68fb92f")
        ]
    (spec_file,) = plugin.paths.cdi_dir.iterdir()
    spec = json.loads(spec_file.read_text())
    assert spec["kind"] == "gpu.gpushare.io/claim"
    assert spec["annotations"]["gpu.gpushare.io/memory"] == f"GPU-bbbb={8 << 30}"


def test_each_claim_gets_its_own_error_and_the_others_are_prepared(
    plugin: DraPlugin, dra: pb_grpc.DRAPluginStub, claims: Claims
) -> None:
    good = REF
    missing = ClaimRef(namespace="ns", name="gone", uid="9f00")
    malformed = ClaimRef(namespace="ns", name="bad", uid="9f01")
    claims.stored[(good.namespace, good.name)] = claim(result())
    claims.stored[(malformed.namespace, malformed.name)] = {
        **claim(result(memory="lots")),
        "metadata": {"uid": malformed.uid},
    }
    reply = dra.NodePrepareResources(
        pb.NodePrepareResourcesRequest(claims=[wire(good), wire(missing), wire(malformed)]), timeout=5
    )
    assert reply.claims[good.uid].error == ""
    assert reply.claims[missing.uid].error == "ResourceClaim ns/gone (uid 9f00): ResourceClaim ns/gone: not found"
    assert not reply.claims[missing.uid].devices
    assert "ResourceClaim ns/bad (uid 9f01): status.allocation.devices.results[0].consumedCapacity.memory" in (
        reply.claims[malformed.uid].error
    )
    assert [p.name for p in plugin.paths.cdi_dir.iterdir()] == [f"gpu.gpushare.io-claim_{good.uid}.json"]


def test_unprepare_removes_the_spec_and_answers_every_claim_even_unprepared_ones(
    plugin: DraPlugin, dra: pb_grpc.DRAPluginStub, claims: Claims
) -> None:
    claims.stored[(REF.namespace, REF.name)] = claim(result())
    dra.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=[wire(REF)]), timeout=5)
    never = ClaimRef(namespace="ns", name="never", uid="9f02")
    for _ in range(2):
        reply = dra.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=[wire(REF), wire(never)]), timeout=5)
        assert {uid: r.error for uid, r in reply.claims.items()} == {REF.uid: "", never.uid: ""}
        assert list(plugin.paths.cdi_dir.iterdir()) == []


def prepare(dra: pb_grpc.DRAPluginStub, *refs: ClaimRef) -> dict[str, str]:
    reply = dra.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=[wire(r) for r in refs]), timeout=5)
    return {uid: r.error for uid, r in reply.claims.items()}


def forty(claims: Claims, i: int, device: str = "card-0") -> ClaimRef:
    """A claim of 40 GiB of ``device`` (an 80 GiB card), as a bad ResourceSlice could let the allocator
    give out past the card."""
    ref = ClaimRef(namespace="ns", name=f"forty-{i}", uid=f"0000000{i}-1111-2222-3333-444455556666")
    claims.stored[(ref.namespace, ref.name)] = claim(result(device=device, memory="40Gi"), uid=ref.uid, name=ref.name)
    return ref


def test_no_card_is_prepared_past_its_memory_over_all_the_claims_prepared_on_it(
    plugin: DraPlugin, dra: pb_grpc.DRAPluginStub, claims: Claims
) -> None:
    first, second, third = (forty(claims, i) for i in range(3))
    assert prepare(dra, first, second) == {first.uid: "", second.uid: ""}
    assert prepare(dra, first) == {first.uid: ""}  # asked again: it doesn't count against itself
    refused = (
        f"ResourceClaim {third}: card 0 (GPU-aaaa) can't take its 40960 MiB: the claims prepared on this node hold "
        "81920 MiB of its 81920 MiB"
    )
    assert prepare(dra, third) == {third.uid: refused}
    assert not (plugin.paths.cdi_dir / f"gpu.gpushare.io-claim_{third.uid}.json").exists()
    elsewhere = forty(claims, 3, device="card-1")
    assert prepare(dra, elsewhere) == {elsewhere.uid: ""}  # card 1 has room

    # a restarted plugin learns what the claims hold from their specs; an unprepared claim frees its share
    plugin.stop()
    again = DraPlugin(plugin.paths, DraService(NODE, lambda: CARDS, 1024, claims, plugin.paths.cdi_dir))
    again.start()
    try:
        for stub in kubelet_dra(again):
            assert prepare(stub, third) == {third.uid: refused}
            stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=[wire(first)]), timeout=5)
            assert prepare(stub, third) == {third.uid: ""}
    finally:
        again.stop()


def test_stop_removes_both_sockets(root: Path, claims: Claims) -> None:
    paths = PluginPaths(kubelet_root=root / "kubelet", cdi_dir=root / "cdi")
    running = DraPlugin(paths, DraService(NODE, lambda: CARDS, 1024, claims, paths.cdi_dir))
    running.start()
    assert paths.registration_socket.is_socket() and paths.dra_socket.is_socket()
    running.stop()
    assert not paths.registration_socket.exists() and not paths.dra_socket.exists()
