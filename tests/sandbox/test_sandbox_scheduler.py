"""The sandbox's kube-scheduler stand-in: node choice and the unschedulable message."""

from gpushare.sandbox.scheduler import best_host, unschedulable_reason


def test_highest_score_wins_and_ties_go_by_name() -> None:
    prios = [{"Host": "b", "Score": 7}, {"Host": "a", "Score": 7}, {"Host": "c", "Score": 3}]
    assert best_host(prios, ["c", "b", "a"]) == "a"
    assert best_host([{"Host": "c", "Score": 10}, *prios[:2]], ["a", "b", "c"]) == "c"


def test_unschedulable_reason_lists_every_node() -> None:
    reason = unschedulable_reason(2, {"n2": "no single card has 90 GiB free", "n1": "card 0 unhealthy"})
    assert reason == "0/2 nodes are available: n1: card 0 unhealthy; n2: no single card has 90 GiB free"
