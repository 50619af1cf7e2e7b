"""The openb trace replay on a tiny synthetic trace: arrival order, dropping, the metric and the report."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import trace_replay as tr
from openb import NODE_FILE, TracePod, load_nodes, load_pods, pod_file

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,65536,2,T4\nn1,32000,65536,2,V100M16\n"
POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
)


def write_trace(directory: Path, pods: list[str], name: str = "tiny") -> None:
    (directory / NODE_FILE).write_text(NODES)
    (directory / pod_file(name)).write_text(POD_HEADER + "".join(f"{p},LS,Running,0,0,0\n" for p in pods))


def test_loader_reads_gpu_spec_and_ignores_milli_of_cpu_only_pods(tmp_path: Path) -> None:
    write_trace(tmp_path, ["p0,4000,1024,1,500,T4|A10", "p1,4000,1024,0,1000,"])
    pods = load_pods(tmp_path / pod_file("tiny"))
    assert pods[0].models == frozenset({"T4", "A10"}) and pods[0].gpu_request == 500
    assert pods[1].gpu_milli == 0 and pods[1].models == frozenset()
    assert [n.gpus for n in load_nodes(tmp_path / NODE_FILE)] == [2, 2]


def test_arrival_order_shuffles_originals_then_adds_clones_up_to_the_load() -> None:
    pods = [TracePod(f"p{i}", 1000, 1024, 1, 1000, frozenset()) for i in range(3)]
    order = tr.arrival_order(list(reversed(pods)), seed=5, capacity_milli=4000)
    assert sorted(p.name for p in order[:3]) == ["p0", "p1", "p2"]
    assert sum(p.gpu_request for p in order) == 5000  # a sixth pod would pass 1.3 x 4000
    assert order == tr.arrival_order(pods, seed=5, capacity_milli=4000)


@pytest.mark.parametrize("policy", tr.REPLAY_POLICIES)
def test_replay_drops_what_does_not_fit_and_averages_per_arrival_bucket(tmp_path: Path, policy: str) -> None:
    write_trace(tmp_path, [f"p{i},4000,1024,1,1000," for i in range(3)])
    _, _, buckets = tr.run_job(tr.Job(tmp_path, "tiny", policy, 42))
    # five whole-card pods arrive on four cards: the fifth is dropped but still counts as arrived
    assert buckets == {25: 25.0, 50: 50.0, 75: 75.0, 100: 100.0, 125: 100.0}


def test_replay_filters_by_model_and_cpu(tmp_path: Path) -> None:
    # only n0 has T4s: the third T4 pod is dropped though n1's cards are idle
    write_trace(tmp_path, ["g0,8000,1024,1,1000,T4", "g1,8000,1024,1,1000,T4", "g2,8000,1024,1,1000,T4"], "model")
    # 20 CPUs each: one pod per node, whatever the free cards
    write_trace(tmp_path, [f"c{i},20000,1024,1,1000," for i in range(3)], "cpu")
    cluster = tr.Cluster.of(load_nodes(tmp_path / NODE_FILE))
    for trace in ("model", "cpu"):
        pods = load_pods(tmp_path / pod_file(trace))
        for policy in tr.REPLAY_POLICIES:
            buckets = tr.replay(cluster, pods, policy, tr.TypicalPods.of(pods, cluster), 1)
            assert buckets == {25: 25.0, 50: 50.0, 75: 50.0}, (trace, policy)


def test_fgd_shares_cards_tighter_than_spread(tmp_path: Path) -> None:
    # 600 + 400 shares fill one card exactly under fgd; spread scatters them and strands the rest
    write_trace(
        tmp_path,
        [
            "a,1000,1024,1,600,",
            "b,1000,1024,1,400,",
            "c,1000,1024,1,600,",
            "d,1000,1024,1,400,",
            "e,1000,1024,1,1000,",
            "f,1000,1024,1,1000,",
        ],
    )
    cluster = tr.Cluster.of(load_nodes(tmp_path / NODE_FILE))
    pods = sorted(load_pods(tmp_path / pod_file("tiny")), key=lambda p: p.name)
    typical = tr.TypicalPods.of(pods, cluster)
    assert max(tr.replay(cluster, pods, "fgd", typical, 1).values()) == 100.0
    assert max(tr.replay(cluster, pods, "spread", typical, 1).values()) < 100.0


def test_report_puts_our_medians_next_to_the_papers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_trace(tmp_path, [f"p{i},4000,1024,1,1000," for i in range(3)])
    (tmp_path / "paper_alloc_medians.csv").write_text(
        "workload,policy,alloc90,alloc100,alloc130,seeds\n"
        "openb_pod_list_tiny,05-BestFit,90.0,92.9,93.1,10\nopenb_pod_list_tiny,02-DotProd,89.9,90.5,90.8,10\n"
    )
    assert (
        tr.main(
            [
                "--trace",
                "tiny",
                "--trace-dir",
                str(tmp_path),
                "--seeds",
                "1-2",
                "--policies",
                "binpack",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| binpack | nan | 100.00 | nan | 05-BestFit | 90.00 | 92.90 | 93.10 |" in out
    assert "| - | - | - | - | 02-DotProd | 89.90 | 90.50 | 90.80 |" in out
    assert tr.parse_seeds("42-44,50") == [42, 43, 44, 50]
