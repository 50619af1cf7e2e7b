"""Card rules: the models a pod accepts or avoids, the NVLink / NUMA topology and the memory limits it
requires, as placement applies them and as the contract reads them from pod annotations."""

import numpy as np
import pytest

from gpushare.cards import ENFORCED, NOT_REPORTED
from gpushare.contract.cardrule import card_rule_annotations, parse_card_rule
from gpushare.contract.errors import AnnotationError
from gpushare.contract.names import (
    ANN_GPU_MODEL,
    ANN_GPU_MODEL_AVOID,
    ANN_REQUIRE_MEMORY_LIMIT,
    ANN_REQUIRE_NVLINK,
    ANN_REQUIRE_SAME_NUMA,
)
from gpushare.placement import (
    ANY_CARD,
    POLICIES,
    CardCapacity,
    CardRule,
    Demand,
    NoFit,
    Shape,
    batch_place,
    check_fit,
    model_matches,
    node_cost,
    place,
)

BINPACK, FGD = POLICIES["binpack"], POLICIES["fgd"]
A100 = CardRule(models=frozenset({"A100-80GB"}))


@pytest.mark.parametrize(
    ("pattern", "model", "matches"),
    [
        ("A100-80GB", "NVIDIA A100-SXM4-80GB", True),
        ("A100-80GB", "NVIDIA A100 80GB PCIe", True),
        ("a100-80gb", "A100-80GB", True),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", True),
        ("A100", "NVIDIA A100-PCIE-40GB", True),
        ("T4", "Tesla T4", True),
        ("A100-80GB", "NVIDIA A100-PCIE-40GB", False),
        ("A10", "NVIDIA A100-SXM4-80GB", False),
        ("V100M16", "V100M32", False),
        ("T4", "Tesla T40", False),
    ],
)
def test_a_pattern_matches_when_each_of_its_words_is_a_word_of_the_model(pattern, model, matches) -> None:
    assert model_matches(pattern, model) is matches


def mixed_node(free_a: int = 80, free_t: int = 16) -> list[CardCapacity]:
    """Two A100-80GB (NVLink peers, NUMA 0), a T4 and an unbridged A100 (NUMA 1)."""
    return [
        CardCapacity(0, "GPU-a0", 80, 80 - free_a, numa=0, nvlink=frozenset({"GPU-a1"}), model="NVIDIA A100-SXM4-80GB"),
        CardCapacity(1, "GPU-a1", 80, 80 - free_a, numa=0, nvlink=frozenset({"GPU-a0"}), model="NVIDIA A100-SXM4-80GB"),
        CardCapacity(2, "GPU-t4", 16, 16 - free_t, numa=1, model="Tesla T4"),
        CardCapacity(3, "GPU-a3", 80, 80 - free_a, numa=1, model="NVIDIA A100-SXM4-80GB"),
    ]


def test_a_model_rule_places_only_on_cards_of_the_model() -> None:
    node = mixed_node()
    # binpack would take the T4 (least free that fits); the rule leaves it out
    (plain,) = place(node, [Demand("main", 10)], BINPACK)
    assert plain.cards[0][0] == 2
    (ruled,) = place(node, [Demand("main", 10)], BINPACK, rule=A100)
    assert ruled.cards[0][0] in (0, 1, 3)
    (avoiding,) = place(node, [Demand("main", 10)], BINPACK, rule=CardRule(avoid=frozenset({"T4"})))
    assert avoiding.cards[0][0] != 2
    (t4,) = place(node, [Demand("main", 10)], BINPACK, rule=CardRule(models=frozenset({"T4"})))
    assert t4.cards[0][0] == 2


def test_the_no_fit_reason_names_the_model_and_the_cards_ignored() -> None:
    node = mixed_node(free_a=20, free_t=16)
    reason = check_fit(node, [Demand("main", 30)], rule=A100).reason
    assert reason == "no A100-80GB card has 30 GiB free (largest free: 20 GiB on card 0; Tesla T4 cards ignored)"
    only_t4 = [mixed_node()[2]]
    assert check_fit(only_t4, [Demand("main", 1)], rule=A100).reason == (
        "no A100-80GB card on the node (Tesla T4 cards ignored)"
    )
    whole = check_fit(mixed_node(free_a=20), [Demand("main", 0, 1, exclusive=True)], rule=A100).reason
    assert whole == "needs a whole free A100-80GB card, 0 completely free (4 cards; Tesla T4 cards ignored)"
    avoid = check_fit(node, [Demand("main", 18)], rule=CardRule(avoid=frozenset({"A100"}))).reason
    assert avoid.startswith("no non-A100 card has 18 GiB free")
    # the answer is the same whichever way the node is asked
    with pytest.raises(NoFit) as nofit:
        place(node, [Demand("main", 30)], FGD, rule=A100)
    assert nofit.value.reason == reason


def test_require_nvlink_takes_only_nvlink_peers_and_says_so_when_there_are_none() -> None:
    pair = Demand("main", 0, 2, exclusive=True)
    nvlink = CardRule(nvlink=True)
    (placed,) = place(mixed_node(), [pair], BINPACK, rule=nvlink)
    assert sorted(i for i, _, _ in placed.cards) == [0, 1]
    busy = mixed_node()
    busy[1] = CardCapacity(1, "GPU-a1", 80, 10, numa=0, nvlink=frozenset({"GPU-a0"}), model=busy[1].model)
    assert check_fit(busy, [pair]) is None  # two free cards, just not peers
    reason = check_fit(busy, [pair], rule=nvlink).reason
    assert reason.startswith("no cards pairwise NVLink-connected (required) can take 2 whole free cards (free GiB:")
    with pytest.raises(NoFit):
        node_cost(busy, [pair], FGD, rule=nvlink)


def test_the_topology_rule_spans_all_of_the_pods_containers() -> None:
    node = mixed_node()
    demands = [Demand("a", 10), Demand("b", 10)]
    same_numa = CardRule(same_numa=True)
    placed = place(node, demands, POLICIES["spread"], rule=same_numa)
    numa = {node[i].numa for a in placed for i, _, _ in a.cards}
    assert len(numa) == 1
    nvlink_a100 = CardRule(models=frozenset({"A100"}), nvlink=True)
    placed = place(node, demands, POLICIES["spread"], rule=nvlink_a100)
    used = sorted({i for a in placed for i, _, _ in a.cards})
    assert used in ([0, 1], [0], [1])
    # both containers on one card needs no link at all
    one_card = [CardCapacity(0, "GPU-x", 80, 0, model="T4")]
    assert check_fit(one_card, demands, rule=CardRule(nvlink=True, same_numa=True)) is None


def test_the_vectorised_path_agrees_with_the_per_node_one_under_a_model_rule() -> None:
    rng = np.random.default_rng(7)
    models = np.array(["NVIDIA A100-SXM4-80GB", "Tesla T4"])[rng.integers(0, 2, size=(40, 4))]
    capacity = np.full((40, 4), 80)
    free = rng.integers(0, 81, size=(40, 4))
    allowed = np.vectorize(A100.accepts)(models)
    for shape in (Shape(30), Shape(0, 2, exclusive=True), Shape(10, 2)):
        choice = batch_place(FGD, capacity, free, shape, allowed=allowed)
        for n in range(40):
            node = [CardCapacity(j, f"GPU-{j}", 80, int(80 - free[n, j]), model=str(models[n, j])) for j in range(4)]
            demand = Demand("main", shape.units, shape.cards, shape.exclusive)
            if check_fit(node, [demand], rule=A100) is not None:
                assert choice.cost[n] == np.inf
                continue
            assert choice.cost[n] == pytest.approx(node_cost(node, [demand], FGD, rule=A100), abs=1e-9)


def test_violation_names_the_card_and_the_rule() -> None:
    node = mixed_node()
    assert A100.violation(node[:2]) is None
    assert A100.violation(node[1:3]) == "card 2 (GPU-t4) is a Tesla T4 card; the pod takes only A100-80GB cards"
    assert CardRule(nvlink=True).violation([node[0], node[3]]) == (
        "cards 0 and 3 are not pairwise NVLink-connected, as the pod requires"
    )
    unknown = [CardCapacity(0, "GPU-u0", 1, 0), CardCapacity(1, "GPU-u1", 1, 0)]
    assert CardRule(same_numa=True).violation(unknown) is not None  # NUMA unknown: not provably one node
    assert ANY_CARD.violation(node) is None


def pod(annotations: dict[str, str]) -> dict:
    return {"metadata": {"namespace": "ml", "name": "train", "annotations": annotations}}


def test_annotations_parse_into_a_rule_and_back() -> None:
    annotations = {
        ANN_GPU_MODEL: "A100-80GB | A100-40GB",
        ANN_GPU_MODEL_AVOID: "A100-PCIE-40GB",
        ANN_REQUIRE_NVLINK: "true",
        ANN_REQUIRE_SAME_NUMA: "False",
    }
    rule = parse_card_rule(pod(annotations))
    assert rule == CardRule(frozenset({"A100-80GB", "A100-40GB"}), frozenset({"A100-PCIE-40GB"}), nvlink=True)
    assert parse_card_rule(pod(card_rule_annotations(rule))) == rule
    assert parse_card_rule(pod({})) is ANY_CARD
    assert parse_card_rule({"metadata": {}}) is ANY_CARD


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (ANN_GPU_MODEL, "", "names no card model"),
        (ANN_GPU_MODEL, "A100;rm -rf", "'A100;rm -rf' is not a card model"),
        (ANN_GPU_MODEL_AVOID, "x" * 2000, "is longer than 1024 characters"),
        (ANN_REQUIRE_NVLINK, "yes", "'yes' is neither 'true' nor 'false'"),
        (ANN_REQUIRE_SAME_NUMA, "1", "'1' is neither 'true' nor 'false'"),
    ],
)
def test_bad_annotations_are_refused_naming_pod_and_annotation(key: str, value: str, message: str) -> None:
    with pytest.raises(AnnotationError) as refused:
        parse_card_rule(pod({key: value}))
    assert str(refused.value).startswith(f"pod ml/train annotation {key}: ")
    assert message in str(refused.value)


NO_DRIVER = "the driver has no per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1 needs release 615 or later)"
HYBRID = "cgroup hybrid (the driver's memory limits need cgroup v2)"
LIMITED = CardRule(memory_limits=True)


def limits_node(*causes: str, free: int = 80) -> list[CardCapacity]:
    """One 80-unit A100 per cause, ``free`` units free on each; ENFORCED cards enforce memory limits."""
    return [
        CardCapacity(i, f"GPU-{i}", 80, 80 - free, model="NVIDIA A100-SXM4-80GB", memory_limits=cause)
        for i, cause in enumerate(causes)
    ]


def test_a_pod_requiring_memory_limits_is_placed_only_on_cards_that_enforce_them() -> None:
    node = limits_node(NO_DRIVER, ENFORCED, HYBRID)
    (assignment,) = place(node, [Demand("main", 10)], BINPACK, rule=LIMITED)
    assert assignment.cards == ((1, "GPU-1", 10),)
    assert LIMITED.admits(node[1]) and not LIMITED.admits(node[0]) and ANY_CARD.admits(node[0])
    # without the requirement, binpack takes the first card
    assert place(node, [Demand("main", 10)], BINPACK)[0].cards[0][0] == 0
    assert check_fit(node, [Demand("main", 0, 2, exclusive=True)], rule=LIMITED) is not None


def test_a_node_without_enforcing_cards_is_refused_naming_each_card_and_its_cause() -> None:
    node = limits_node(NO_DRIVER, NO_DRIVER, HYBRID)
    refused = check_fit(node, [Demand("main", 10)], rule=LIMITED)
    assert refused is not None
    assert refused.reason == (
        "no limit-enforcing card on the node (cards 0 (GPU-0), 1 (GPU-1) don't enforce GPU memory limits: "
        f"{NO_DRIVER}; card 2 (GPU-2) doesn't enforce GPU memory limits: {HYBRID})"
    )
    # an enforcing card too full: the cards passed over are named with their cause
    full = check_fit(limits_node(ENFORCED, HYBRID, free=5), [Demand("main", 10)], rule=LIMITED)
    assert full is not None and full.reason == (
        "no limit-enforcing card has 10 GiB free (largest free: 5 GiB on card 0; "
        f"card 1 (GPU-1) doesn't enforce GPU memory limits: {HYBRID})"
    )


def test_the_vectorised_mask_takes_memory_limits_in_as_the_per_card_rule_does() -> None:
    enforced = np.array([[True, False], [False, False]])
    card_models = np.array([[0, 1], [1, 1]])
    models = ("NVIDIA A100-SXM4-80GB", "Tesla T4")
    assert LIMITED.card_mask(card_models, models, enforced).tolist() == [[True, False], [False, False]]
    both = CardRule(models=frozenset({"T4"}), memory_limits=True)
    assert both.card_mask(card_models, models, enforced).tolist() == [[False, False], [False, False]]
    assert A100.card_mask(card_models, models).tolist() == [[True, False], [False, False]]
    with pytest.raises(ValueError, match="which cards enforce them"):
        LIMITED.card_mask(card_models, models)


def test_violation_names_a_card_without_memory_limits_and_why() -> None:
    node = limits_node(ENFORCED, NOT_REPORTED)
    assert LIMITED.violation(node[:1]) is None
    assert LIMITED.violation(node) == f"card 1 (GPU-1) doesn't enforce GPU memory limits: {NOT_REPORTED}"
    assert ANY_CARD.violation(node) is None


@pytest.mark.parametrize(("value", "required"), [("true", True), ("False", False)])
def test_the_memory_limit_annotation_parses_into_the_rule_and_back(value: str, required: bool) -> None:
    rule = parse_card_rule(pod({ANN_REQUIRE_MEMORY_LIMIT: value}))
    assert rule.memory_limits is required
    assert parse_card_rule(pod(card_rule_annotations(rule))) == rule
    assert (ANN_REQUIRE_MEMORY_LIMIT in card_rule_annotations(rule)) is required


def test_a_bad_memory_limit_annotation_is_refused_naming_pod_and_annotation() -> None:
    with pytest.raises(AnnotationError) as refused:
        parse_card_rule(pod({ANN_REQUIRE_MEMORY_LIMIT: "yes"}))
    assert (
        str(refused.value) == f"pod ml/train annotation {ANN_REQUIRE_MEMORY_LIMIT}: 'yes' is neither 'true' nor 'false'"
    )
