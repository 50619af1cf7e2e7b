import json
from pathlib import Path

import pytest
from gpushare.draplugin.cdi import cdi_device_id, cdi_spec, remove_spec, spec_file_name, write_spec
from support.draclaims import CARDS, NODE, REF, claim, result

from gpushare.contract.resourceclaim import ClaimError, claim_allocation

GIB = 1024


def spec_for(*results: dict, unit_mib: int = GIB) -> dict:
    return cdi_spec(claim_allocation(claim(*results), REF, NODE), CARDS, unit_mib)


def test_a_share_gets_the_device_plugin_env_for_its_card_and_units() -> None:
    spec = spec_for(result(device="card-1", memory="8Gi"))
    assert spec["cdiVersion"] == "0.6.0"
    assert spec["kind"] == "gpu.gpushare.io/claim"
    assert spec["devices"] == [
        {
            "name": f"{REF.uid}-gpu",
            "containerEdits": {
                "env": [
                    "NVIDIA_VISIBLE_DEVICES=GPU-bbbb",
                    "ALIYUN_COM_GPU_MEM_IDX=1",
                    "ALIYUN_COM_GPU_MEM_POD=8",
                    "ALIYUN_COM_GPU_MEM_CONTAINER=8",
                    "ALIYUN_COM_GPU_MEM_DEV=80",
                ]
            },
        }
    ]
    assert cdi_device_id(REF.uid, "gpu") == f"gpu.gpushare.io/claim={REF.uid}-gpu"


def test_each_request_gets_its_own_device_with_its_own_cards() -> None:
    spec = spec_for(
        result(device="card-0", memory="4Gi", request="a"),
        result(device="card-1", memory="2Gi", request="b"),
        result(device="card-0", memory="1Gi", request="b"),
    )
    env = {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}
    assert env[f"{REF.uid}-a"][:4] == [
        "NVIDIA_VISIBLE_DEVICES=GPU-aaaa",
        "ALIYUN_COM_GPU_MEM_IDX=0",
        "ALIYUN_COM_GPU_MEM_POD=7",
        "ALIYUN_COM_GPU_MEM_CONTAINER=4",
    ]
    assert env[f"{REF.uid}-b"][:4] == [
        "NVIDIA_VISIBLE_DEVICES=GPU-bbbb,GPU-aaaa",
        "ALIYUN_COM_GPU_MEM_IDX=1,0",
        "ALIYUN_COM_GPU_MEM_POD=7",
        "ALIYUN_COM_GPU_MEM_CONTAINER=3",
    ]


def test_units_follow_the_node_memory_unit() -> None:
    env = spec_for(result(memory="1536Mi"), unit_mib=512)["devices"][0]["containerEdits"]["env"]
    assert "ALIYUN_COM_GPU_MEM_CONTAINER=3" in env
    assert "ALIYUN_COM_GPU_MEM_DEV=160" in env


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
