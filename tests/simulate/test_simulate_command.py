"""``gpushare simulate`` as a user meets it: without matplotlib, on a small or mixed cluster, with odd or
hostile input, redirected output, and the plot it draws."""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpushare.cli import main as gpushare
from gpushare.contract.allocation import CardSlice, format_allocation
from gpushare.contract.inventory import format_inventory
from gpushare.contract.names import ANN_ALLOCATION, ANN_GPU_MODEL, NODE_ANN_INVENTORY, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import simulated_cards
from gpushare.simulate import report, runs, snapshot
from gpushare.simulate.replay import ARRIVALS
from gpushare.simulate.trace import load_nodes, load_pods

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,65536,2,T4\nn1,32000,65536,2,V100M16\n"
POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"


def files(directory: Path, pods: list[str], nodes: str = NODES) -> list[str]:
    """The CSVs written, as simulate's arguments (one seed, one policy unless more are added)."""
    (directory / "nodes.csv").write_text(nodes)
    (directory / "pods.csv").write_text(POD_HEADER + "".join(f"{p}\n" for p in pods))
    return ["simulate", "--nodes", str(directory / "nodes.csv"), "--pods", str(directory / "pods.csv")]


def simulate(tmp_path: Path, pods: list[str], *extra: str, nodes: str = NODES) -> int:
    return gpushare([*files(tmp_path, pods, nodes), "--out", str(tmp_path / "out"), *extra])


def table_rows(summary: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells[1:]
        for line in summary.splitlines()
        if line.startswith("| ") and not line.startswith("| policy")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }


SHARES = [f"p{i},1000,1024,1,{300 + 100 * i}," for i in range(4)]


# --- without matplotlib -------------------------------------------------------------------------------


def test_without_matplotlib_it_says_so_first_and_still_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert simulate(tmp_path, SHARES, "--seeds", "1", "--policy", "default") == 0
    out, err = capsys.readouterr()
    assert "| default |" in out
    note = [line for line in err.splitlines() if "matplotlib" in line]
    assert note == ["gpushare simulate: matplotlib is missing, so no plot; pip install 'gpushare[simulate]' draws it"]
    assert err.index(note[0]) < err.index("run(s)")  # said before the replays start
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.csv", "summary.md"]


# --- a small cluster ------------------------------------------------------------------------------------

# one node of 3 cards; each pod a third or two thirds of a card: every pod moves the arrivals 10-20%
SMALL_NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,3,A10\n"
SMALL_PODS = [f"p{i},1000,1024,1,{[300, 600][i % 2]}," for i in range(6)]


def test_a_small_cluster_gets_a_value_at_every_mark_and_a_note_saying_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert simulate(tmp_path, SMALL_PODS, "--seeds", "1-3", "--policy", "default", nodes=SMALL_NODES) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    row = table_rows(summary)["default"]
    assert row[:2] != ["-", "-"] and all(cell[0].isdigit() for cell in row[:2]), summary
    assert "arrivals jumped over the" in summary
    with (tmp_path / "out" / "results.csv").open() as f:
        assert all(r["alloc90"] and r["alloc100"] for r in csv.DictReader(f))


def test_a_mark_no_seed_reached_is_explained() -> None:
    # whole-card pods on 4 cards stop at 100%: no clone fits under 130%
    done = [runs.Run.of("t", "binpack", s, [(25, 25.0), (50, 50.0), (75, 75.0), (100, 100.0)]) for s in (1, 2)]
    summary = report.markdown("t", done, {})
    # the arrivals jumped from 75% to 100%: at 90% the allocation is what it was after 75%
    assert table_rows(summary)["binpack"] == ["75.00", "100.00", "-"]
    assert "arrivals stopped at 100-100%" in summary


def test_the_median_counts_the_seeds_that_reached_a_mark() -> None:
    done = [
        runs.Run.of("t", "spread", 1, [(70, 70.0), (130, 90.0)]),
        runs.Run.of("t", "spread", 2, [(70, 70.0), (120, 80.0)]),
    ]
    assert table_rows(report.markdown("t", done, {}))["spread"] == ["70.00", "70.00", "90.00 (1 of 2 seeds)"]


# --- the snapshot of a live cluster ---------------------------------------------------------------------

MIXED = simulated_cards("mixed", "1xA100-40GB:40960,2xA10:24576")


def gpu_node(name: str, cards: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": {NODE_ANN_INVENTORY: format_inventory(cards, GIB)}},
        "status": {"allocatable": {"cpu": "32", "memory": "128Gi"}},
    }


def gpu_pod(name: str, limits: dict[str, str], node: str | None, annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", "annotations": annotations},
        "spec": {
            **({"nodeName": node} if node else {}),
            "containers": [{"name": "main", "image": "x", "resources": {"limits": limits, "requests": {"cpu": "2"}}}],
        },
    }


def on_card(card: Any, units: int) -> dict[str, str]:
    return {ANN_ALLOCATION: format_allocation({"main": (CardSlice(card.index, card.uuid, units),)})}


def test_from_cluster_keeps_mixed_cards_card_rules_pending_pods_and_each_cards_size(
    core_v1: client.CoreV1Api, kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    core_v1.create_node(gpu_node("mixed", MIXED))
    pods = [
        # 10 GiB of the 40 GiB A100: a quarter of it, not 10/24 of the node's usual A10
        gpu_pod("on-a100", {RESOURCE_MEM: "10"}, "mixed", {**on_card(MIXED[0], 10), ANN_GPU_MODEL: "A100"}),
        gpu_pod("on-a10", {RESOURCE_MEM: "6"}, "mixed", on_card(MIXED[1], 6)),
        gpu_pod("waiting", {RESOURCE_MEM: "20"}, None, {ANN_GPU_MODEL: "A100"}),
        gpu_pod("whole", {RESOURCE_COUNT: "2"}, None, {}),
    ]
    for p in pods:
        core_v1.create_namespaced_pod("team", p)
    out = tmp_path / "out"
    args = ["simulate", "--from-cluster", "--kubeconfig", str(kubeconfig), "--out", str(out)]
    assert gpushare([*args, "--seeds", "1", "--policy", "default"]) == 0
    assert (out / "nodes.csv").read_text().splitlines()[1] == "mixed,32000,131072,3,A100-40GB;A10;A10"
    with (out / "pods.csv").open() as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    shapes = {name: (r["num_gpu"], r["gpu_milli"], r["gpu_spec"], r["pod_phase"]) for name, r in rows.items()}
    assert shapes == {
        "team/on-a100": ("1", "250", "A100", "Pending"),
        "team/on-a10": ("1", "250", "", "Pending"),
        "team/waiting": ("1", "500", "A100", "Pending"),  # measured against the A100 its rule accepts
        "team/whole": ("2", "1000", "", "Pending"),
    }
    err = capsys.readouterr().err
    assert "1 node(s) with 3 card(s) (1 of mixed models), 4 GPU pod(s), 2 of them not placed yet" in err


def test_a_pod_no_card_can_hold_is_replayed_as_one_whole_card_with_a_warning_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cards = simulated_cards("big", "2xA100-80GB:81920")
    pods = [gpu_pod("too-big", {RESOURCE_MEM: "100"}, None, {}), gpu_pod("fits", {RESOURCE_MEM: "40"}, None, {})]
    with caplog.at_level(logging.WARNING, logger="gpushare.simulate.snapshot"):
        shot = snapshot.take([gpu_node("big", cards)], pods)
    assert {row[0]: (row[3], row[4]) for row in shot.pod_rows} == {"team/too-big": (1, 1000), "team/fits": (1, 500)}
    (warning,) = caplog.messages
    assert warning == (
        f"pod team/too-big asks 100 {RESOURCE_MEM} units of one card, more than the 80 of the card it is measured "
        "against: replayed as one whole card"
    )
    assert "1 pod(s) ask more than a card holds, replayed as whole cards (see the warnings above)" in shot.summary()


def test_a_pod_or_node_with_a_quantity_too_large_to_count_is_left_out_by_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tenant's ``cpu: 1e30`` (or a node's) is left out of the snapshot with a line naming it, and
    the rest is replayed as before."""
    cards = simulated_cards("big", "2xA100-80GB:81920")
    huge = gpu_pod("huge", {RESOURCE_MEM: "8"}, None, {})
    huge["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "1e30"
    odd = gpu_node("odd", simulated_cards("odd", "1xA10:24576"))
    odd["status"]["allocatable"]["memory"] = "1e999999"
    with caplog.at_level(logging.WARNING, logger="gpushare.simulate.snapshot"):
        shot = snapshot.take([gpu_node("big", cards), odd], [huge, gpu_pod("fits", {RESOURCE_MEM: "8"}, None, {})])
    assert [row[0] for row in shot.pod_rows] == ["team/fits"]
    assert [row[0] for row in shot.node_rows] == ["big"]
    assert shot.left_out == 2
    assert any("pod team/huge container 'main' requests cpu" in m for m in caplog.messages), caplog.messages
    assert any("node odd allocatable memory" in m for m in caplog.messages), caplog.messages


def test_a_mixed_node_gives_each_card_model_its_own_rule(tmp_path: Path) -> None:
    nodes = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,3,A100-40GB;A10;A10\n"
    # two whole-card pods that take only an A100: the node has one, so the second is dropped
    for policy in runs.policy_names():
        files(tmp_path, ["a,1000,1,1,1000,A100", "b,1000,1,1,1000,A100"], nodes)
        run = runs.run_one("t", load_nodes(tmp_path / "nodes.csv"), load_pods(tmp_path / "pods.csv"), policy, 1)
        assert run.last[67] == pytest.approx(100 / 3), policy


def test_a_node_with_the_wrong_number_of_card_models_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,3,A100-40GB;A10\n"
    assert simulate(tmp_path, SHARES, nodes=nodes) == 2
    assert (
        "nodes.csv line 2 column model: 'A100-40GB;A10' names 2 card model(s) for 3 GPU(s)" in capsys.readouterr().err
    )


# --- what the command says --------------------------------------------------------------------------------


def test_a_model_no_node_has_is_a_warning_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pods = ["p0,1000,1,1,500,T4", "p1,1000,1,1,500,H100|T4", "p2,1000,1,1,500,H100"]
    assert simulate(tmp_path, pods, "--seeds", "1", "--policy", "binpack") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert "pods.csv line 3 column gpu_spec: no node has model 'H100' (2 pod(s) ask for it" in warnings[0]


def test_the_extenders_default_policy_is_replayed_once_under_one_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert simulate(tmp_path, SHARES, "--seeds", "1", "--policy", "default", "--policy", "fgdfit") == 0
    assert list(table_rows(capsys.readouterr().out)) == ["default"]
    # with no --policy, each policy once: the default under its own name
    every = runs.policies_to_run(None)
    assert "default" not in every and every.count("fgdfit") == 1 and len(every) == len(set(every))
    assert runs.policies_to_run(["fgdfit", "binpack", "default"]) == ["fgdfit", "binpack"]


def test_the_table_mentions_the_papers_values_only_when_it_shows_some(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert simulate(tmp_path, SHARES, "--seeds", "1", "--policy", "binpack") == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "paper" not in summary and "bracket" not in summary


def test_redirected_output_gets_no_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate(tmp_path, SHARES, "--seeds", "1-3", "--policy", "binpack") == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert "3 run(s), 1 policy(ies) x 3 seed(s), 1 at a time" in err


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpushare(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "one process each (default: 1)" in text
    assert "(default: 42-51)" in text and "(default: simulate-out)" in text


# --- hostile input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pods", "message"),
    [
        (
            [f"p0,{10**23},1024,1,500,"],
            "pods.csv line 2 column cpu_milli: 100000000000000000000000 must be between 0 and 1000000000",
        ),
        (["p0,1000,1024,1,500,", f"p1,1000,{2**41},0,0,"], "pods.csv line 3 column memory_mib: 2199023255552 must be"),
        ([f"p0,1000,1024,0,0,{'A' * 200_000}"], "pods.csv line 2: a field is longer than 131072 characters"),
        ([f"p0,{'9' * 5000},1024,0,0,"], "pods.csv line 2 column cpu_milli: '99999"),
    ],
)
def test_hostile_pod_files_get_one_line_naming_the_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pods: list[str], message: str
) -> None:
    assert simulate(tmp_path, pods, "--seeds", "1", "--policy", "paper-fgd") == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1 and len(err) < 300


def test_a_trace_without_gpu_pods_is_refused_rather_than_replayed_forever(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert simulate(tmp_path, ["c0,1000,1024,0,0,", "c1,2000,1024,0,0,"], "--seeds", "1", "--policy", "binpack") == 2
    assert "pods.csv: no pod requests a GPU, so there is no GPU allocation to replay" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_names_the_line_and_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = files(tmp_path, SHARES)
    (tmp_path / "nodes.csv").write_bytes(b"sn,cpu_milli,memory_mib,gpu,model\nn0,32000,65536,2,T4\nn\xe91,1,1,1,T4\n")
    assert gpushare([*args, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("nodes.csv line 3 column sn: byte 0xe9 is not UTF-8")


@pytest.mark.parametrize("seeds", ["1-2000", "1-600,601-1200", "1-200000000"])
def test_too_many_seeds_are_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seeds: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        simulate(tmp_path, SHARES, "--seeds", seeds)
    assert exited.value.code == 2
    assert f"argument --seeds: '{seeds}' gives more than 1000 seeds" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- the plot ---------------------------------------------------------------------------------------------


def test_the_plot_reads_at_a_glance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    drawn: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k)))
    policies = ["default", "binpack", "spread", "paper-bestfit", "paper-fgd"]
    args = ["--seeds", "1-3", *(a for p in policies for a in ("--policy", p))]
    assert simulate(tmp_path, SMALL_PODS * 3, *args, nodes=SMALL_NODES) == 0
    assert (tmp_path / "out" / "allocation.png").read_bytes()[:4] == b"\x89PNG"
    (figure,) = drawn
    axes = figure.axes[0]
    assert axes.get_xlim()[0] == 0 and axes.get_ylim() == (0, 100)  # both axes from 0, up to a full cluster
    lines = {line.get_label(): line for line in axes.get_lines() if line.get_label() in policies}
    assert sorted(lines) == sorted(policies)
    assert len({line.get_color() for line in lines.values()}) == len(policies)  # a colour each
    for policy, line in lines.items():
        assert len(line.get_xdata()) > 1, policy  # a line, not an empty plot
        markers = [m for m in axes.get_lines() if m.get_marker() == "o" and m.get_color() == line.get_color()]
        assert [list(m.get_xdata()) for m in markers] == [list(ARRIVALS)], policy
    assert len(axes.collections) >= len(policies)  # a band across the seeds for each
