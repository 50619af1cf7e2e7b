"""The sandbox's kube-scheduler stand-in: node choice and the unschedulable message."""

from gpushare.sandbox.scheduler import best_host, filter_outcome, unschedulable_reason


def test_highest_score_wins_and_ties_go_by_name() -> None:
    prios = [{"Host": "b", "Score": 7}, {"Host": "a", "Score": 7}, {"Host": "c", "Score": 3}]
    assert best_host(prios, ["c", "b", "a"]) == "a"
    assert best_host([{"Host": "c", "Score": 10}, *prios[:2]], ["a", "b", "c"]) == "c"


def test_unschedulable_reason_counts_each_reason_as_kube_scheduler_does() -> None:
    refused = {"n2": "no single card has 90 GiB free", "n1": "card 0 unhealthy", "n3": "card 0 unhealthy"}
    assert unschedulable_reason(3, refused) == (
        "0/3 nodes are available: 1 no single card has 90 GiB free, 2 card 0 unhealthy."
    )
    assert unschedulable_reason(2, {}) == "0/2 nodes are available:"


def test_an_unresolvable_reason_is_shown_even_when_failed_nodes_is_empty_and_wins_over_it() -> None:
    reply = {"NodeNames": [], "FailedNodes": {"a": "full"}, "FailedAndUnresolvableNodes": {"a": "bad", "b": "bad"}}
    assert filter_outcome(reply, ["a", "b", "c"]) == ([], "0/3 nodes are available: 2 bad.")


def test_an_extender_error_is_the_whole_message_and_passing_nodes_go_on() -> None:
    reply = {"NodeNames": ["a"], "FailedNodes": {"b": "full"}, "Error": "pod default/x: broken"}
    assert filter_outcome(reply, ["a", "b"]) == ([], "pod default/x: broken")
    assert filter_outcome({**reply, "Error": ""}, ["a", "b"]) == (["a"], "")
    assert filter_outcome({**reply, "Error": "", "NodeNames": ["z"]}, ["a", "b"]) == (
        [],
        "extender claims a filtered node 'z' which is not found in the input node list",
    )
