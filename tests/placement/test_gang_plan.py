"""The gang planner and the gang labels, without I/O."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from gpushare.extender.asks import read_ask

from gpushare import placement
from gpushare.cards import ENFORCED
from gpushare.contract.gang import Gang, GangError, format_gang, parse_gang
from gpushare.contract.names import LABEL_GANG, LABEL_GANG_MIN
from gpushare.contract.pending import PendingBind, format_pending_binds, parse_pending_binds
from gpushare.placement import gangplan as gang_module
from gpushare.placement.gangplan import Member, Room, Spot, plan_gang, within
from gpushare.sandbox.examples import with_string_quantities

BINPACK = placement.POLICIES["binpack"]
FREE = (1 << 40, 1 << 50)


def cards(*sizes: int, used: dict[int, int] | None = None) -> tuple[placement.CardCapacity, ...]:
    return tuple(placement.CardCapacity(i, f"GPU-{i}", size, (used or {}).get(i, 0)) for i, size in enumerate(sizes))


def members(count: int, units: int, host: tuple[int, int] = (0, 0)) -> list[Member]:
    return [Member(f"uid-{i}", f"default/w-{i}", (placement.Demand("main", units),), host) for i in range(count)]


def test_eight_members_fit_exactly_and_a_blocker_leaves_room_for_seven() -> None:
    room = Room("b", cards(40, 24, 24), FREE)
    plan = plan_gang(members(8, 10), [room], BINPACK)
    assert len(plan.spots) == 8 and not plan.unplaced
    per_card: dict[str, int] = {}
    for spot in plan.spots.values():
        for uuid, units in spot.held.items():
            per_card[uuid] = per_card.get(uuid, 0) + units
    assert per_card == {"GPU-0": 40, "GPU-1": 20, "GPU-2": 20}

    blocked = Room("b", cards(40, 24, 24, used={1: 10}), FREE)
    plan = plan_gang(members(8, 10), [blocked], BINPACK)
    assert len(plan.spots) == 7 and len(plan.unplaced) == 1
    assert "no single card has 10 GiB free" in plan.reason


def test_members_are_spread_over_nodes_and_cpu_memory_counts() -> None:
    rooms = [Room("a", cards(80), (4000, 1 << 40)), Room("b", cards(80), (2000, 1 << 40))]
    plan = plan_gang(members(4, 10, host=(1500, 0)), rooms, BINPACK)
    by_node = sorted(spot.node for spot in plan.spots.values())
    assert by_node == ["a", "a", "b"], "a takes two members by CPU, b one, the fourth fits nowhere"
    assert "not enough CPU or memory" in plan.reason


def test_a_member_goes_only_where_its_node_selector_allows() -> None:
    rooms = [Room("a", cards(80), FREE), Room("b", cards(80), FREE)]
    member = Member("u", "default/w", (placement.Demand("main", 10),), nodes=frozenset({"b"}))
    assert plan_gang([member], rooms, BINPACK).spots["u"].node == "b"
    stuck = Member("u", "default/w", (placement.Demand("main", 10),), nodes=frozenset())
    assert plan_gang([stuck], rooms, BINPACK).unplaced == ("default/w",)


def test_a_member_gets_only_cards_of_the_model_it_asks_for() -> None:
    t4 = tuple(placement.CardCapacity(i, f"T4-{i}", 16, 4, model="Tesla T4") for i in range(2))
    a100 = (placement.CardCapacity(0, "A100-0", 80, 60, model="NVIDIA A100-SXM4-80GB"),)
    rooms = [Room("a", t4, FREE), Room("b", a100, FREE)]
    demand = (placement.Demand("main", 10),)
    wants_a100 = placement.CardRule(models=frozenset({"A100"}))
    plan = plan_gang([Member("u", "default/w", demand, rule=wants_a100)], rooms, BINPACK)
    assert plan.spots["u"] == Spot("b", {"A100-0": 10}), "binpack alone would take the fuller T4 node's card"
    # a previous place on cards of another model is not kept
    plan = plan_gang(
        [Member("u", "default/w", demand, rule=wants_a100)], rooms, BINPACK, {"u": Spot("a", {"T4-0": 10})}
    )
    assert plan.spots["u"].node == "b"
    # no card of the model has room: the member is unplaced, and the reason names the model
    full = [Room("a", t4, FREE), Room("b", (placement.CardCapacity(0, "A100-0", 80, 75, model="A100"),), FREE)]
    plan = plan_gang([Member("u", "default/w", demand, rule=wants_a100)], full, BINPACK)
    assert plan.unplaced == ("default/w",) and "A100" in plan.reason, plan.reason


def test_a_member_requiring_memory_limits_gets_only_cards_that_enforce_them() -> None:
    unlimited = Room("a", (placement.CardCapacity(0, "GPU-a", 80, 60, memory_limits="cgroup hybrid"),), FREE)
    limited = Room("b", (placement.CardCapacity(0, "GPU-b", 80, 0, memory_limits=ENFORCED),), FREE)
    member = Member("u", "default/w", (placement.Demand("main", 10),), rule=placement.CardRule(memory_limits=True))
    plan = plan_gang([member], [unlimited, limited], BINPACK)
    assert plan.spots["u"] == Spot("b", {"GPU-b": 10}), "binpack alone would take the fuller card on a"
    plan = plan_gang([member], [unlimited], BINPACK)
    assert plan.unplaced == ("default/w",)
    assert "card 0 (GPU-a) doesn't enforce GPU memory limits: cgroup hybrid" in plan.reason, plan.reason


def test_a_previous_place_is_kept_while_it_fits() -> None:
    rooms = [Room("a", cards(80), FREE), Room("b", cards(80), FREE)]
    (member,) = members(1, 10)
    previous = {member.uid: Spot("b", {"GPU-0": 10})}
    assert plan_gang([member], rooms, BINPACK, previous).spots[member.uid] == Spot("b", {"GPU-0": 10})
    # the held card is gone (unhealthy): the member is planned afresh
    sick = [rooms[0], Room("b", (placement.CardCapacity(0, "GPU-0", 80, 0, healthy=False),), FREE)]
    assert plan_gang([member], sick, BINPACK, previous).spots[member.uid].node == "a"


def test_whole_card_members_take_whole_empty_cards() -> None:
    room = Room("a", cards(80, 80, 80, used={2: 1}), FREE)
    whole = [Member(f"u{i}", f"default/w{i}", (placement.Demand("main", 0, exclusive=True),)) for i in range(3)]
    plan = plan_gang(whole, [room], BINPACK)
    assert sorted(next(iter(s.held)) for s in plan.spots.values()) == ["GPU-0", "GPU-1"]
    assert all(list(s.held.values()) == [80] for s in plan.spots.values())


def test_within_leaves_only_the_held_units_usable() -> None:
    limited = within(cards(80, 24, used={0: 30}), {"GPU-0": 10})
    assert [c.free for c in limited] == [10, 0]
    assert [c.free for c in within(cards(80, used={0: 75}), {"GPU-0": 10})] == [5]


def test_gang_labels_parse_and_refuse_clearly() -> None:
    pod = {"metadata": {"name": "w", "namespace": "ml", "labels": format_gang("train-42", 8)}}
    assert parse_gang(pod) == Gang("ml", "train-42", 8) and parse_gang(pod).key == "ml/train-42"
    assert parse_gang({"metadata": {"name": "solo"}}) is None
    for labels, fault in (
        ({LABEL_GANG: "g"}, LABEL_GANG_MIN),
        ({LABEL_GANG_MIN: "2"}, LABEL_GANG),
        ({LABEL_GANG: "g", LABEL_GANG_MIN: "0"}, "'0'"),
        ({LABEL_GANG: "g", LABEL_GANG_MIN: "two"}, "'two'"),
    ):
        with pytest.raises(GangError, match=fault) as info:
            parse_gang({"metadata": {"name": "w", "namespace": "ml", "labels": labels}})
        assert "pod ml/w" in str(info.value)
    with pytest.raises(GangError):
        format_gang("g", 0)


def test_a_hold_round_trips_through_the_node_annotation_and_outlives_a_bind() -> None:
    hold = PendingBind("ml/w", {"GPU-0": 10}, 1000.0, "ml/train-42")
    plain = PendingBind("ml/x", {"GPU-0": 4}, 1000.0)
    assert parse_pending_binds(format_pending_binds({"a": hold, "b": plain})) == {"a": hold, "b": plain}
    assert hold.expires() > plain.expires() > 1000.0


def test_the_gang_example_is_one_gang_of_gpu_pods() -> None:
    path = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "gang" / "train-4.yaml"
    pods = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    gangs = {parse_gang(pod) for pod in pods}
    assert gangs == {Gang("default", "train-4", len(pods))}
    assert all(read_ask(with_string_quantities(pod)).demands for pod in pods)
    assert len({pod["metadata"]["name"] for pod in pods}) == len(pods)


def test_a_thousand_alike_members_over_a_hundred_nodes_cost_each_node_once_per_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0
    real = gang_module.node_cost

    def counted(*args: object, **kwargs: object) -> float:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(gang_module, "node_cost", counted)
    rooms = [Room(f"node-{i:03d}", cards(80, 80, 80, 80, 80, 80, 80, 80), FREE) for i in range(100)]
    plan = plan_gang(members(1000, 4), rooms, BINPACK)
    assert len(plan.spots) == 1000
    # each node once for the first member, then only the node the last member went to: not 1000 x 100
    assert calls <= 1000 + 100, calls


def test_a_node_takes_no_more_members_than_it_has_room_for_pods() -> None:
    rooms = [Room("a", cards(80), FREE, pods=2), Room("b", cards(80), FREE, pods=1)]
    plan = plan_gang(members(4, 10), rooms, BINPACK)
    assert sorted(spot.node for spot in plan.spots.values()) == ["a", "a", "b"]
    assert len(plan.unplaced) == 1 and "room for no more pods" in plan.reason
