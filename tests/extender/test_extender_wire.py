"""Replies written by joining plain node names are byte for byte what ``json.dumps`` writes; the
wording of a refusal of every node."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from gpushare.extender.verbs import refusal_message
from gpushare.extender.wire import NodeNames, Raw, encode

#: names JSON writes with escapes
ESCAPED = ['say "hi"', "back\\slash", "tab\there", "del\x7f", "caf\u00e9", "\u2603", '", "']
#: names JSON writes as they are, odd as they look
PLAIN = ["", " ", "a, b", "[x]", "{y}: z"]


def random_names(rng: random.Random, count: int, odd: bool) -> list[str]:
    names = [f"node-{rng.randrange(10**6):06d}.zone-{rng.choice('abc')}" for _ in range(count)]
    if odd and names:
        names[rng.randrange(len(names))] = rng.choice(ESCAPED)
    return names


@pytest.mark.parametrize("odd", [False, True])
def test_name_lists_and_priority_lists_are_what_json_dumps_writes(odd: bool) -> None:
    rng = random.Random(3)
    for count in (0, 1, 2, 7, 500):
        names = random_names(rng, count, odd)
        scores = np.array([rng.randint(0, 10) for _ in names], dtype=np.int64)
        got = NodeNames.of(names)
        assert (got.text is None) == (odd and count > 0)
        assert encode(got.json()) == json.dumps(names).encode()
        expected = [{"Host": n, "Score": s} for n, s in zip(names, scores.tolist(), strict=True) if s]
        assert encode(got.priorities(scores)) == json.dumps(expected).encode()


def test_every_odd_name_is_written_as_json_does() -> None:
    for name in ESCAPED + PLAIN:
        names = ["plain", name]
        assert (NodeNames.of(names).text is None) == (name in ESCAPED)
        assert encode(NodeNames.of(names).json()) == json.dumps(names).encode()
        scores = np.array([3, 10])
        expected = [{"Host": "plain", "Score": 3}, {"Host": name, "Score": 10}]
        assert encode(NodeNames.of(names).priorities(scores)) == json.dumps(expected).encode()


def test_nodes_scoring_zero_are_left_out_as_kube_scheduler_counts_them_zero() -> None:
    names = NodeNames.of(["a", "b", "c"])
    assert encode(names.priorities(np.array([0, 7, 0]))) == b'[{"Host": "b", "Score": 7}]'
    assert encode(names.priorities(np.zeros(3, dtype=np.int64))) == b"[]"


def test_a_list_with_a_non_string_is_refused() -> None:
    with pytest.raises(TypeError):
        NodeNames.of(["a", 3])  # type: ignore[list-item]


def test_raw_values_stand_in_for_top_level_values_only_where_given() -> None:
    reply = {"FailedNodes": {"n2": 'no "room"'}, "Error": "", "NodeNames": Raw('["n1"]'), "Nodes": None}
    plain = {**reply, "NodeNames": ["n1"]}
    assert encode(reply) == json.dumps(plain).encode()
    assert encode(plain) == json.dumps(plain).encode()
    assert encode(Raw("[]")) == b"[]"


def test_the_refusal_event_names_the_nodes_of_each_reason_unless_it_is_every_node() -> None:
    assert refusal_message({"a": "full", "b": "full"}, 2) == "full"
    refused = {"a": "full", "b": "full", "c": "no inventory", **{f"n{i}": "gone" for i in range(5)}}
    assert refusal_message(refused, 8) == ("nodes n0, n1, n2 and 2 more: gone; nodes a, b: full; node c: no inventory")
    assert len(refusal_message({"a": "x" * 5000}, 1)) == 1024
