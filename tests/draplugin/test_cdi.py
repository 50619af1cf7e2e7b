import json
from pathlib import Path

import pytest
from gpushare.draplugin.cdi import SpecError, cdi_spec, prepared_memory, remove_spec, spec_file_name, write_spec
from support.draclaims import CARDS, NODE, REF, claim, result

from gpushare.contract.dra import DraMemoryError, format_claim_cdi_device
from gpushare.contract.resourceclaim import ClaimError, claim_allocation

GIB = 1024


def spec_for(*results: dict, unit_mib: int = GIB) -> dict:
    return cdi_spec(claim_allocation(claim(*results), REF, NODE), CARDS, unit_mib)


def test_a_share_gets_a_device_that_sets_no_gpu_env_and_the_spec_records_what_the_claim_holds() -> None:
    """The GPU env (NVIDIA_VISIBLE_DEVICES, ALIYUN_COM_GPU_MEM_*) is the CRI shim's to set over all of a
    container's claims: a CDI device setting it would override the shim's (containerd applies CDI env
    edits last)."""
    spec = spec_for(result(device="card-1", memory="8Gi"))
    assert spec["cdiVersion"] == "0.6.0"
    assert spec["kind"] == "gpu.gpushare.io/claim"
    assert spec["annotations"] == {
        "gpu.gpushare.io/claim": "ns/claim-1",
        "gpu.gpushare.io/memory": "GPU-bbbb=8589934592",
    }
    assert spec["devices"] == [
        {
            "name": f"{REF.uid}-gpu",
            "containerEdits": {"env": ["GPUSHARE_CLAIM_0B5C9F1E_1111_2222_3333_444455556666_GPU=GPU-bbbb"]},
        }
    ]
    assert format_claim_cdi_device(REF.uid, "gpu") == f"gpu.gpushare.io/claim={REF.uid}-gpu"


def test_each_request_gets_its_own_device_and_the_memory_is_summed_per_card() -> None:
    spec = spec_for(
        result(device="card-0", memory="4Gi", request="a"),
        result(device="card-1", memory="2Gi", request="b"),
        result(device="card-0", memory="1Gi", request="b"),
    )
    env = {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}
    key = f"GPUSHARE_CLAIM_{REF.uid.upper().replace('-', '_')}"
    assert env == {f"{REF.uid}-a": [f"{key}_A=GPU-aaaa"], f"{REF.uid}-b": [f"{key}_B=GPU-bbbb,GPU-aaaa"]}
    assert spec["annotations"]["gpu.gpushare.io/memory"] == f"GPU-aaaa={5 << 30},GPU-bbbb={2 << 30}"


def test_what_each_prepared_claim_holds_is_read_back_from_its_spec(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    assert prepared_memory(cdi) == {}
    write_spec(cdi, REF.uid, spec_for(result(device="card-0", memory="8Gi"), result(device="card-1", memory="2Gi")))
    write_spec(cdi, "u2", {**spec_for(result(memory="1Gi")), "kind": "gpu.gpushare.io/claim"})
    (cdi / "vendor.example-other.json").write_text("not ours")
    assert prepared_memory(cdi) == {REF.uid: {"GPU-aaaa": 8 << 30, "GPU-bbbb": 2 << 30}, "u2": {"GPU-aaaa": 1 << 30}}


@pytest.mark.parametrize(
    ("text", "error", "fault"),
    [
        ("{broken", SpecError, "can't be read"),
        ('{"devices": []}', DraMemoryError, "annotation gpu.gpushare.io/memory: None is not"),
        ('{"annotations": {"gpu.gpushare.io/memory": "GPU-aaaa=lots"}}', DraMemoryError, "'GPU-aaaa=lots' is not"),
    ],
    ids=["not-json", "no-annotation", "bad-amount"],
)
def test_a_spec_that_doesnt_say_what_its_claim_holds_is_an_error_naming_the_file(
    tmp_path: Path, text: str, error: type, fault: str
) -> None:
    """Never read as holding nothing: its claim's memory would be offered again."""
    (tmp_path / spec_file_name("u9")).write_text(text)
    with pytest.raises(error) as err:
        prepared_memory(tmp_path)
    assert f"CDI spec {tmp_path / spec_file_name('u9')}" in str(err.value) and fault in str(err.value)


def test_units_follow_the_node_memory_unit() -> None:
    with pytest.raises(ClaimError, match="is not a whole number of 1024 MiB units"):
        spec_for(result(memory="1536Mi"))
    assert spec_for(result(memory="1536Mi"), unit_mib=512)["annotations"]["gpu.gpushare.io/memory"] == (
        f"GPU-aaaa={1536 << 20}"
    )


@pytest.mark.parametrize(
    ("share", "fault"),
    [
        (result(device="card-7"), "request gpu device card-7: no card with index 7 on this node"),
        (result(memory="1500Mi"), "is not a whole number of 1024 MiB units"),
        (result(memory="100Gi"), "consumedCapacity.memory 102400 MiB exceeds the card's 81920 MiB"),
    ],
)
def test_a_share_this_node_cannot_honour_is_refused_naming_claim_and_device(share: dict, fault: str) -> None:
    with pytest.raises(ClaimError) as err:
        spec_for(share)
    assert f"ResourceClaim ns/claim-1 (uid {REF.uid})" in str(err.value)
    assert fault in str(err.value)


def test_the_spec_file_is_written_whole_and_removed_once(tmp_path: Path) -> None:
    spec = spec_for(result())
    path = write_spec(tmp_path / "cdi", REF.uid, spec)
    assert path.name == spec_file_name(REF.uid)
    assert json.loads(path.read_text()) == spec
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    write_spec(tmp_path / "cdi", REF.uid, spec)
    assert remove_spec(tmp_path / "cdi", REF.uid) is True
    assert remove_spec(tmp_path / "cdi", REF.uid) is False
    assert list(path.parent.iterdir()) == []
