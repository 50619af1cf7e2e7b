"""The contract: request semantics and every annotation parse/format pair."""

import json

import pytest
from podfactory import gpu_pod

from gpushare.cards import Card
from gpushare.contract.aliyun import format_assume_time, parse_assume_time, parse_card_index
from gpushare.contract.allocation import CardSlice, format_allocation, parse_allocation, validate_allocation
from gpushare.contract.env import assigned_env
from gpushare.contract.errors import AnnotationError, ContractError, RequestError
from gpushare.contract.inventory import format_inventory, format_model_label, parse_inventory
from gpushare.contract.names import (
    ANN_ALLOCATION,
    ANN_MEM_IDX,
    ENV_MEM_CONTAINER,
    ENV_MEM_DEV,
    ENV_MEM_IDX,
    ENV_MEM_POD,
    ENV_VISIBLE_DEVICES,
    NODE_ANN_PENDING_BINDS,
    RESOURCE_COUNT,
    RESOURCE_MEM,
)
from gpushare.contract.pending import PendingBind, format_pending_binds, parse_pending_binds
from gpushare.contract.request import parse_pod_request
from gpushare.contract.units import GIB, format_unit, parse_unit
from gpushare.gpus.simulated import simulated_cards
from gpushare.holdings.pod import pod_allocation


def pod(containers, init=(), annotations=None, name="p", uid="u1"):
    def ctr(name, mem=None, count=None):
        limits = {}
        if mem is not None:
            limits[RESOURCE_MEM] = mem
        if count is not None:
            limits[RESOURCE_COUNT] = count
        return {"name": name, "resources": {"limits": limits}}

    specs, init_specs = [ctr(*x) for x in containers], [ctr(*x) for x in init]
    return gpu_pod(name, specs, init=init_specs, node=None, namespace="ns", uid=uid, extra_annotations=annotations)


def test_request_semantics_mem_count_and_both() -> None:
    req = parse_pod_request(pod([("a", "8"), ("b", None, "2"), ("d", "12", "3"), ("e",)], init=[("i", 4)]))
    by = {x.name: x for x in req.containers}
    assert [x.name for x in req.containers] == ["i", "a", "b", "d", "e"]  # init containers first
    assert by["i"].init and not by["a"].init
    assert (by["a"].cards, by["a"].units_per_card, by["a"].exclusive) == (1, 8, False)
    assert (by["b"].cards, by["b"].units_per_card, by["b"].exclusive) == (2, 0, True)
    assert (by["d"].cards, by["d"].units_per_card, by["d"].exclusive) == (3, 4, False)
    assert not by["e"].wants_gpu
    assert [x.name for x in req.gpu_containers] == ["i", "a", "b", "d"]
    assert req.app_mem == 8 + 12
    assert req.effective_mem == 20  # the init container's 4 runs before, inside the app containers' 20
    bigger_init = parse_pod_request(pod([("a", "6")], init=[("i", 9), ("j", 2)]))
    assert (bigger_init.app_mem, bigger_init.effective_mem) == (6, 9)


def test_indivisible_request_is_rejected_naming_container() -> None:
    with pytest.raises(RequestError, match=r"pod ns/p container d: .*gpu-mem=10 is not divisible by .*gpu-count=3"):
        parse_pod_request(pod([("d", "10", "3")]))


@pytest.mark.parametrize("bad", ["1.5", "-1", "8Gi", "", True])
def test_non_integer_quantities_are_rejected(bad) -> None:
    with pytest.raises(RequestError, match="container a"):
        parse_pod_request(pod([("a", bad)]))


def test_units() -> None:
    assert parse_unit("GiB").units_of(81920) == 80
    assert parse_unit("MiB").units_of(15360) == 15360
    u = parse_unit("256MiB")
    assert (u.mib, u.units_of(15360), format_unit(u)) == (256, 60, "256MiB")
    for bad in ("KiB", "0MiB", "GB", "12"):
        with pytest.raises(ContractError, match="memory unit"):
            parse_unit(bad)


UUID_A = "GPU-5778203f-3d9e-535e-b0bc-024184b555e8"
UUID_B = "GPU-d9c3948d-1519-5c73-a571-8613affee367"
#: two cards whose /dev/nvidia minors equal their indices
CARDS = (Card(0, UUID_A, "A100", 81920, minor=0), Card(1, UUID_B, "A100", 81920, minor=1))


def test_allocation_round_trip() -> None:
    alloc = {"b": (CardSlice(1, UUID_B, 4), CardSlice(0, UUID_A, 4)), "a": (CardSlice(0, UUID_A, 8),)}
    assert parse_allocation(format_allocation(alloc)) == alloc


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "expected an object"),
        ('{"a": []}', "no card list"),
        ('{"a": [{"index": "x", "uuid": "GPU-1", "units": 1}]}', "card index 'x'"),
        ('{"a": [{"index": -1, "uuid": "GPU-1", "units": 1}]}', "card index -1"),
        ('{"a": [{"index": 0, "uuid": "nvidia0", "units": 1}]}', "not a GPU UUID"),
        ('{"a": [{"index": 0, "uuid": "GPU-1", "units": 0}]}', "units 0"),
        (
            '{"a": [{"index": 0, "uuid": "GPU-1", "units": 1}, {"index": 0, "uuid": "GPU-1", "units": 1}]}',
            "twice",
        ),
    ],
)
def test_bad_allocation_annotations_name_pod_and_field(text, message) -> None:
    with pytest.raises(AnnotationError, match=message) as err:
        parse_allocation(text, "ns/p")
    assert "pod ns/p" in str(err.value) and ANN_ALLOCATION in str(err.value)


def test_pod_allocation_prefers_ours_and_falls_back_to_original_keys() -> None:
    ours = format_allocation({"a": (CardSlice(1, UUID_B, 8),)})
    p = pod([("a", "8")], annotations={ANN_ALLOCATION: ours, ANN_MEM_IDX: "0"})
    assert pod_allocation(p, CARDS) == {"a": (CardSlice(1, UUID_B, 8),)}

    orig = pod([("a", "8"), ("b", "2")], annotations={ANN_MEM_IDX: "1"})
    got = pod_allocation(orig, CARDS)
    assert got == {"a": (CardSlice(1, UUID_B, 8),), "b": (CardSlice(1, UUID_B, 2),)}

    assert pod_allocation(pod([("a", "8")]), CARDS) is None
    with pytest.raises(AnnotationError, match="ALIYUN_COM_GPU_MEM_IDX: 'x' is not an integer"):
        pod_allocation(pod([("a", "8")], annotations={ANN_MEM_IDX: "x"}), CARDS)


def test_allocation_naming_a_container_without_gpu_is_rejected() -> None:
    p = pod(
        [("a", "8"), ("sidecar",)],
        annotations={
            ANN_ALLOCATION: format_allocation({"a": (CardSlice(0, UUID_A, 8),), "sidecar": (CardSlice(1, UUID_B, 8),)})
        },
    )
    with pytest.raises(AnnotationError, match="sidecar"):
        pod_allocation(p, CARDS)


def test_validate_allocation_shape() -> None:
    req = parse_pod_request(pod([("d", "12", "3")]))
    with pytest.raises(AnnotationError, match="requests 3 card"):
        validate_allocation(req, {"d": (CardSlice(0, UUID_A, 4),)})
    with pytest.raises(AnnotationError, match="requests 4 unit"):
        validate_allocation(req, {"d": (CardSlice(0, UUID_A, 4), CardSlice(1, UUID_B, 4), CardSlice(2, "GPU-c", 5))})
    with pytest.raises(AnnotationError, match="assigns it no card"):
        validate_allocation(req, {})


def test_assume_time_and_index_parsing() -> None:
    assert parse_assume_time(format_assume_time(1700000000123456789)) == 1700000000123456789
    with pytest.raises(AnnotationError, match="ASSUME_TIME"):
        parse_assume_time("yesterday", "ns/p")
    with pytest.raises(AnnotationError, match="is negative"):
        parse_card_index("-2", "ns/p")


def test_assigned_env_for_two_cards() -> None:
    env = assigned_env((CardSlice(0, UUID_A, 4), CardSlice(1, UUID_B, 4)), 8, {UUID_A: 80, UUID_B: 80})
    assert env == {
        ENV_VISIBLE_DEVICES: f"{UUID_A},{UUID_B}",
        ENV_MEM_IDX: "0,1",
        ENV_MEM_POD: "8",
        ENV_MEM_CONTAINER: "8",
        ENV_MEM_DEV: "80",
    }


def test_inventory_round_trip_and_errors() -> None:
    cards = simulated_cards("n1", "2xA100-80GB:81920,1xT4:15360")
    text = format_inventory(cards, GIB)
    inv = parse_inventory(text, "n1")
    assert inv.cards == tuple(cards) and inv.unit == GIB
    assert [card["units"] for card in json.loads(text)["cards"]] == [80, 80, 15]
    with pytest.raises(AnnotationError, match=r"node n1 .*version"):
        parse_inventory('{"version": 99}', "n1")
    broken = json.loads(text)
    del broken["cards"][0]["uuid"]
    with pytest.raises(AnnotationError, match="missing or has a bad field"):
        parse_inventory(json.dumps(broken), "n1")


def test_model_label_is_a_valid_label_value() -> None:
    cards = [Card(0, UUID_A, "NVIDIA A100 80GB PCIe", 81920, 0), Card(1, UUID_B, "T4", 15360, 1)]
    assert format_model_label(cards) == "NVIDIA-A100-80GB-PCIe_T4"


def test_pending_binds_round_trip_and_bad_text_names_the_node() -> None:
    pending = {"u1": PendingBind("default/p", {"GPU-a": 4, "GPU-b": 4}, 1700000000.5)}
    assert parse_pending_binds(format_pending_binds(pending), "n1") == pending
    assert parse_pending_binds(None) == {}
    with pytest.raises(AnnotationError, match=f"node n1 annotation {NODE_ANN_PENDING_BINDS}"):
        parse_pending_binds('{"u1": {"pod": "default/p"}}', "n1")


@pytest.mark.parametrize("parse", [parse_allocation, parse_inventory])
def test_an_annotation_nested_thousands_deep_is_a_contract_error_not_a_crash(parse) -> None:
    """A tenant's (or a forged) annotation of ``[`` x 5000 is refused as malformed, naming the depth,
    before the JSON decoder recurses into it and raises RecursionError."""
    with pytest.raises(ContractError, match="nests more than 64 arrays and objects deep"):
        parse("[" * 5000)
