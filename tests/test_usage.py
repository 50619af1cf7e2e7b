"""Per-card usage from pod annotations: what every component uses to refuse over-commitment."""

from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.names import ANN_ALLOCATION, ANN_MEM_IDX, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.inventory import simulated_cards
from gpushare.usage import node_usage, pod_allocation

CARDS = simulated_cards("n1", "2xA100-80GB:81920,1xT4:15360")
A0, A1, T4 = CARDS


def pod(name, mem, annotations, phase="Pending", count=None):
    limits = {RESOURCE_MEM: str(mem)}
    if count:
        limits[RESOURCE_COUNT] = str(count)
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "annotations": annotations},
        "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {"limits": limits}}]},
        "status": {"phase": phase},
    }


def ours(*slices):
    return {ANN_ALLOCATION: format_allocation({"main": tuple(slices)})}


def test_usage_counts_ours_original_and_ignores_finished() -> None:
    pods = [
        pod("a", 8, ours(CardSlice(0, A0.uuid, 8))),
        pod("b", 4, {ANN_MEM_IDX: str(A0.minor)}),  # written by the original extender: a minor number
        pod("c", 10, ours(CardSlice(2, T4.uuid, 10)), phase="Succeeded"),
        pod("d", 20, ours(CardSlice(0, A0.uuid, 10), CardSlice(1, A1.uuid, 10)), count=2),
        pod("e", 2, {}),  # not scheduled by us yet
    ]
    used, counted, bad = node_usage(pods, CARDS)
    assert used == {A0.uuid: 22, A1.uuid: 10, T4.uuid: 0}
    assert [p.key for p in counted] == ["ns/a", "ns/b", "ns/d"]
    assert bad == []


def test_bad_annotations_are_reported_not_counted_as_free() -> None:
    pods = [pod("x", 4, {ANN_MEM_IDX: "7"}), pod("y", 4, {ANN_ALLOCATION: "{garbage"})]
    used, counted, bad = node_usage(pods, CARDS)
    assert counted == [] and set(used.values()) == {0}
    assert [b.key for b in bad] == ["ns/x", "ns/y"]
    assert "card 7 (a /dev/nvidia minor number) is not on this node" in bad[0].reason
    assert "not valid JSON" in bad[1].reason


def test_a_pod_naming_a_card_the_node_lacks_is_reported_and_counted_nowhere() -> None:
    """As with an unknown minor in the original formats: the pod is a problem, not a partial hold."""
    gone = CardSlice(3, "GPU-gone", 4)
    pods = [pod("z", 8, ours(CardSlice(0, A0.uuid, 4), gone), count=2), pod("a", 8, ours(CardSlice(0, A0.uuid, 8)))]
    used, counted, bad = node_usage(pods, CARDS)
    assert used == {A0.uuid: 8, A1.uuid: 0, T4.uuid: 0}
    assert [p.key for p in counted] == ["ns/a"]
    assert [(b.key, b.reason) for b in bad] == [("ns/z", "pod ns/z: card(s) GPU-gone are not on this node")]


def test_original_index_resolves_as_a_minor_number_through_the_node_inventory() -> None:
    assert [card.minor for card in CARDS] == [2, 1, 0]  # the simulated minors run backwards
    got = pod_allocation(pod("b", 4, {ANN_MEM_IDX: "2"}), CARDS)
    assert got == {"main": (CardSlice(0, A0.uuid, 4),)}
