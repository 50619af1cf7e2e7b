"""The replay on tiny traces: reading the CSVs (and their errors), arrival order, dropping, the metric, the
paper's policies' choices, and ``gpushare simulate``'s outputs."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from gpushare import placement
from gpushare.cli import main as gpushare
from gpushare.simulate import baselines, runs
from gpushare.simulate.replay import Choice, Chooser, ClusterState, arrival_order, replay
from gpushare.simulate.trace import TraceError, TraceNode, TracePod, load_nodes, load_pods

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,65536,2,T4\nn1,32000,65536,2,V100M16\n"
POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n"


def write(directory: Path, pods: list[str], nodes: str = NODES) -> tuple[Path, Path]:
    (directory / "nodes.csv").write_text(nodes)
    (directory / "pods.csv").write_text(POD_HEADER + "".join(f"{p},LS\n" for p in pods))
    return directory / "nodes.csv", directory / "pods.csv"


def run(nodes: Path, pods: Path, policy: str, seed: int = 42) -> dict[int, float]:
    return runs.run_one("t", load_nodes(nodes), load_pods(pods), policy, seed).buckets


def test_loader_reads_gpu_spec_and_ignores_gpu_fields_of_cpu_only_pods(tmp_path: Path) -> None:
    nodes, pods = write(tmp_path, ["p0,4000,1024,1,500,T4|A10", "p1,4000,1024,0,1000,T4"])
    loaded = load_pods(pods)
    assert loaded[0].models == frozenset({"T4", "A10"}) and loaded[0].gpu_request == 500
    assert loaded[1].gpu_milli == 0 and loaded[1].models == frozenset()
    assert [n.gpus for n in load_nodes(nodes)] == [2, 2]


@pytest.mark.parametrize(
    ("pods", "message"),
    [
        (["p0,4000,1024,1,half,"], "pods.csv line 2 column gpu_milli: 'half' is not an integer"),
        (["p0,4000,1024,1,500,", "p1,4000,1024,1,1500,"], "pods.csv line 3 column gpu_milli: 1500 must be between"),
        (["p0,-1,1024,0,0,"], "pods.csv line 2 column cpu_milli: -1 must be between 0 and 1000000000"),
    ],
)
def test_malformed_pods_name_file_line_and_column(tmp_path: Path, pods: list[str], message: str) -> None:
    _, path = write(tmp_path, pods)
    with pytest.raises(TraceError, match=message):
        load_pods(path)


def test_missing_file_and_column_are_named(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nodes\.csv: no such file"):
        load_nodes(tmp_path / "nodes.csv")
    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,gpu,model\nn0,1,1,T4\n")
    with pytest.raises(TraceError, match=r"nodes\.csv line 1: header lacks column\(s\) memory_mib"):
        load_nodes(tmp_path / "nodes.csv")


def test_arrival_order_shuffles_originals_then_adds_clones_up_to_the_load() -> None:
    pods = [TracePod(f"p{i}", 1000, 1024, 1, 1000) for i in range(3)]
    order = arrival_order(list(reversed(pods)), seed=5, capacity_milli=4000)
    assert sorted(p.name for p in order[:3]) == ["p0", "p1", "p2"]
    assert sum(p.gpu_request for p in order) == 5000  # a sixth pod would pass 1.3 x 4000
    assert order == arrival_order(pods, seed=5, capacity_milli=4000)


@pytest.mark.parametrize("policy", runs.policy_names())
def test_every_policy_drops_what_does_not_fit_and_averages_per_bucket(tmp_path: Path, policy: str) -> None:
    nodes, pods = write(tmp_path, [f"p{i},4000,1024,1,1000," for i in range(3)])
    # five whole-card pods arrive on four cards: the fifth is dropped but still counts as arrived
    assert run(nodes, pods, policy) == {25: 25.0, 50: 50.0, 75: 75.0, 100: 100.0, 125: 100.0}


def replayed(tmp_path: Path, policy: str, rows: list[str]) -> runs.Run:
    """The pods of ``rows`` replayed once onto ``NODES`` under ``policy``, as the report runs them."""
    nodes, pods = write(tmp_path, rows)
    state = ClusterState.of(load_nodes(nodes), load_pods(pods))
    chooser = runs.chooser(policy, load_pods(pods), state)
    return runs.Run.of("t", policy, 1, replay(state, load_pods(pods), chooser, 1))


@pytest.mark.parametrize("policy", runs.policy_names())
def test_every_policy_respects_card_models_and_cpu(tmp_path: Path, policy: str) -> None:
    # only n0 has T4s: the third T4 pod is dropped though n1's cards are idle
    rows = ["g0,8000,1024,1,1000,T4", "g1,8000,1024,1,1000,T4", "g2,8000,1024,1,1000,T4"]
    assert replayed(tmp_path, policy, rows).buckets == {25: 25.0, 50: 50.0, 75: 50.0}
    # 20 CPUs each: one pod per node, whatever the free cards
    rows = [f"c{i},20000,1024,1,1000," for i in range(3)]
    assert replayed(tmp_path, policy, rows).buckets == {25: 25.0, 50: 50.0, 75: 50.0}


class AsBound:
    """A chooser that checks each GPU pod's cards against what the bind verb's ``place`` gives on the
    chosen node's cards."""

    def __init__(self, chooser: Chooser) -> None:
        self.chooser = chooser
        self.checked: set[str] = set()

    def choose(self, state: ClusterState, pod: TracePod, rows: np.ndarray, rng: np.random.Generator) -> Choice:
        row, cards = self.chooser.choose(state, pod, rows, rng)
        if pod.num_gpu:
            node = [
                placement.CardCapacity(
                    j, f"card-{j}", int(c), int(c - f), model=state.models[state.card_models[row, j]]
                )
                for j, (c, f) in enumerate(zip(state.capacity[row], state.free[row], strict=True))
                if c
            ]
            shape = pod.shape
            demand = placement.Demand("main", shape.units, shape.cards, shape.exclusive)
            policy = self.chooser.policy  # type: ignore[attr-defined]
            (bound,) = placement.place(node, [demand], policy, unit="milli", rule=placement.CardRule(pod.models))
            assert cards == tuple(index for index, _, _ in bound.cards), pod
            self.checked.add(pod.name)
        return row, cards


@pytest.mark.parametrize("policy", ["default", *placement.POLICIES])
def test_the_extenders_policies_take_the_cards_its_bind_verb_would(tmp_path: Path, policy: str) -> None:
    nodes = (
        "sn,cpu_milli,memory_mib,gpu,model\n"
        "n0,64000,262144,4,A100;A100;T4;T4\nn1,64000,262144,3,V100M16\nn2,64000,262144,2,A100\n"
    )
    shares = [f"s{i},2000,1024,1,{milli}," for i, milli in enumerate((200, 500, 700, 300, 900, 100))]
    picky = ["t0,2000,1024,1,400,T4", "t1,2000,1024,1,600,T4|V100M16", "a0,2000,1024,2,1000,A100"]
    nodes_path, pods_path = write(tmp_path, [*shares, *picky, "w0,2000,1024,2,1000,", "c0,2000,1024,0,0,"], nodes)
    pods = load_pods(pods_path)
    state = ClusterState.of(load_nodes(nodes_path), pods)
    checking = AsBound(runs.chooser(policy, pods, state))
    list(replay(state, arrival_order(pods, 3, state.total_milli), checking, 3))
    # the two-card pods, and a pod that takes only some models, were among those checked
    assert {"a0", "w0", "t1"} <= checking.checked


def state_with(free: list[list[int]], cpu: list[int]) -> ClusterState:
    state = ClusterState.of(
        [TraceNode(f"n{i}", c, 65536, len(f), "T4") for i, (f, c) in enumerate(zip(free, cpu, strict=True))]
    )
    for i, f in enumerate(free):
        state.free[i, : len(f)] = f
    return state


def test_bestfit_scores_as_the_paper_and_takes_the_tightest_card() -> None:
    state = state_with([[1000, 300], [1000, 1000]], [64000, 64000])
    pod = TracePod("p", 8000, 1024, 1, 200)
    policy = baselines.BestFit()
    # 1 - (0.5 x 56000/128000 + 0.5 x 1100/8000) = 0.7125 -> 71; the idle node: 1 - (0.21875 + 0.1125) -> 66
    assert policy.scores(state, np.array([0, 1]), pod).tolist() == [71, 66]
    assert policy.choose(state, pod, np.array([0, 1]), np.random.default_rng(1)) == (0, (1,))


def test_gpupacking_prefers_shared_cards_then_used_nodes_then_idle_ones() -> None:
    state = state_with([[1000, 300], [1000, 1000], [1000, 0]], [64000] * 3)
    policy = baselines.GpuPacking()
    shares = policy.scores(state, np.array([0, 1, 2]), TracePod("s", 1000, 1, 1, 200))
    whole = policy.scores(state, np.array([0, 1, 2]), TracePod("w", 1000, 1, 1, 1000))
    assert shares.tolist() == [97, 31, 49]  # a 300-milli card left: 100 - 30/10; idle node: 33 - 2
    assert whole.tolist() == [49, 31, 49]


def test_fgd_takes_the_card_that_strands_least_for_the_typical_pods() -> None:
    pods = [TracePod(f"h{i}", 1000, 1, 1, 500) for i in range(10)]
    state = state_with([[500, 1000]], [64000])
    policy = baselines.baseline("fgd", pods, state)
    # a 500 share on the half-used card leaves a whole card for the typical half-card pods
    assert policy.choose(state, TracePod("p", 1000, 1, 1, 500), np.array([0]), np.random.default_rng(1)) == (0, (0,))


def test_ties_go_to_the_same_node_order_for_the_whole_run(tmp_path: Path) -> None:
    nodes = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},64000,65536,1,T4\n" for i in range(6))
    nodes_path, pods_path = write(tmp_path, [f"p{i},1000,1,1,100," for i in range(6)], nodes)
    state = ClusterState.of(load_nodes(nodes_path), load_pods(pods_path))
    order = load_pods(pods_path)[:3]
    list(replay(state, order, baselines.BestFit(), 7))
    # bestfit packs the second and third pod onto the node the first pod's tie chose
    assert int((state.free < 1000).sum()) == 1


def test_simulate_writes_results_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = write(tmp_path, [f"p{i},4000,1024,1,{300 + 100 * i}," for i in range(4)])
    (tmp_path / "paper_alloc_medians.csv").write_text(
        "workload,policy,alloc90,alloc100,alloc130,seeds\npods,05-BestFit,90.0,92.9,93.1,10\n"
    )
    out = tmp_path / "out"
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--seeds", "1-2", "--out", str(out)]
    assert gpushare([*args, "--policy", "default", "--policy", "paper-bestfit"]) == 0
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["trace"], r["policy"], r["seed"]) for r in rows] == [
        ("pods", "default", "1"),
        ("pods", "default", "2"),
        ("pods", "paper-bestfit", "1"),
        ("pods", "paper-bestfit", "2"),
    ]
    assert list(rows[0]) == ["trace", "policy", "seed", "alloc90", "alloc100", "alloc130"]
    summary = (out / "summary.md").read_text()
    assert "| paper-bestfit |" in summary and "(92.90)" in summary
    assert (out / "allocation.png").read_bytes()[:4] == b"\x89PNG"


def test_simulate_reports_a_bad_csv_by_file_line_and_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = write(tmp_path, ["p0,4000,1024,x,500,"])
    assert gpushare(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--out", str(tmp_path / "o")]) == 2
    assert "pods.csv line 2 column num_gpu: 'x' is not an integer" in capsys.readouterr().err
    assert gpushare(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "best"]) == 2
