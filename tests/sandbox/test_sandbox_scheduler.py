"""The sandbox's kube-scheduler stand-in: node choice and the unschedulable message; and what a user
sees for the too-big example."""

from gpushare.advertiser.agent import Advertiser
from gpushare.extender.wiring import start_extender
from kubernetes import client
from support.waiting import wait_until

from gpushare.contract.names import RESOURCE_MEM
from gpushare.contract.request import parse_pod_request
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.sandbox.examples import EXAMPLES, load_examples, with_string_quantities
from gpushare.sandbox.nodespec import DEFAULT_NODES, parse_node
from gpushare.sandbox.scheduler import ExtenderClient, best_host, filter_outcome, unschedulable_reason


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


def test_the_too_big_example_is_refused_as_its_comment_says(kube_api: client.ApiClient) -> None:
    """kube-scheduler's resource check turns away the nodes whose cards hold less than the request
    between them; the extender, asked about the rest, names the largest free share."""
    core = client.CoreV1Api(kube_api)
    backends = {}
    for spec in map(parse_node, DEFAULT_NODES):
        core.create_node({"metadata": {"name": spec.name}})
        backends[spec.name] = SimulatedBackend(spec.name, spec.gpus)
        Advertiser(kube_api, spec.name, backends[spec.name], GIB).publish_once()
    manifest = next(m for m in load_examples() if m["metadata"]["name"] == "too-big")
    created = core.create_namespaced_pod("default", with_string_quantities(manifest))
    pod = kube_api.sanitize_for_serialization(created)
    wanted = parse_pod_request(pod).effective_mem
    short = {n for n, b in backends.items() if sum(c.memory_mib for c in b.cards()) // 1024 < wanted}
    extender = start_extender(kube_api, 0, "", host="127.0.0.1")
    try:
        wait_until(lambda: all(extender.cache.view(n) for n in backends), what="the inventories in the cache")
        asked = sorted(set(backends) - short)
        reply = ExtenderClient(f"http://127.0.0.1:{extender.server.port}").call(
            "filter", {"Pod": pod, "NodeNames": asked}
        )
    finally:
        extender.stop()
    refused = dict.fromkeys(short, f"Insufficient {RESOURCE_MEM}") | reply["FailedNodes"]
    # the comment quotes the message on its lines indented by three spaces
    said = [line[4:] for line in EXAMPLES.joinpath("too-big.yaml").read_text().splitlines() if line.startswith("#   ")]
    assert unschedulable_reason(len(backends), refused) == " ".join(said)
