"""Running replays and writing what they found: results.csv (one row per run), a Markdown table of the
medians over seeds (with the FGD paper's published values beside its baselines for openb traces) and a
plot of allocation against arrival per policy, like the paper's Figure 9."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare import placement
from gpushare.simulate.baselines import PAPER_NAMES, baseline
from gpushare.simulate.product import ExtenderChooser, learned
from gpushare.simulate.replay import ARRIVALS, ClusterState, arrival_order, bucket_means, replay
from gpushare.simulate.trace import TraceNode, TracePod

PAPER_PREFIX = "paper-"
#: the paper's published medians, looked for next to the pods file
PAPER_FILE = "paper_alloc_medians.csv"
RESULT_COLUMNS = ("trace", "policy", "seed", *(f"alloc{a}" for a in ARRIVALS))


def policy_names() -> list[str]:
    """Every policy ``simulate`` knows: the extender's default, its policies, then the paper's baselines."""
    return ["default", *placement.POLICIES, *(PAPER_PREFIX + name for name in PAPER_NAMES)]


def chooser(name: str, pods: Sequence[TracePod], state: ClusterState) -> object:
    """The replay's chooser for the policy called ``name`` (one of ``policy_names()``)."""
    if name.startswith(PAPER_PREFIX):
        return baseline(name.removeprefix(PAPER_PREFIX), pods, state)
    return ExtenderChooser(learned(placement.DEFAULT_POLICY if name == "default" else name, pods))


@dataclass(frozen=True, slots=True)
class Run:
    trace: str
    policy: str
    seed: int
    buckets: dict[int, float]

    def row(self) -> list[str]:
        return [self.trace, self.policy, str(self.seed), *(_cell(self.buckets.get(a)) for a in ARRIVALS)]


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def run_one(trace: str, nodes: Sequence[TraceNode], pods: Sequence[TracePod], policy: str, seed: int) -> Run:
    state = ClusterState.of(nodes, pods)
    order = arrival_order(pods, seed, state.total_milli)
    return Run(trace, policy, seed, bucket_means(replay(state, order, chooser(policy, pods, state), seed)))


def write_results(path: Path, runs: Sequence[Run]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(RESULT_COLUMNS)
        writer.writerows(run.row() for run in runs)


def medians(runs: Sequence[Run]) -> dict[str, dict[int, float | None]]:
    """Per policy and bucket: the median over seeds (None where a run never reached the bucket)."""
    table: dict[str, dict[int, float | None]] = {}
    for policy in dict.fromkeys(r.policy for r in runs):
        mine = [r.buckets for r in runs if r.policy == policy]
        buckets = sorted(set().union(*mine))
        table[policy] = {
            b: statistics.median(m[b] for m in mine) if all(b in m for m in mine) else None for b in buckets
        }
    return table


def paper_medians(pods_file: Path, trace: str) -> dict[str, dict[int, float]]:
    """The paper's medians for this trace, by our policy name; empty when it isn't an openb trace."""
    path = pods_file.parent / PAPER_FILE
    if not path.exists():
        return {}
    ours = {paper: PAPER_PREFIX + name for name, paper in PAPER_NAMES.items()}
    with path.open(newline="") as f:
        return {
            ours[row["policy"]]: {a: float(row[f"alloc{a}"]) for a in ARRIVALS}
            for row in csv.DictReader(f)
            if row.get("workload") == trace and row.get("policy") in ours
        }


def markdown(trace: str, runs: Sequence[Run], paper: dict[str, dict[int, float]]) -> str:
    seeds = sorted({r.seed for r in runs})
    head = [f"alloc @ {a}% arrived" for a in ARRIVALS]
    lines = [
        f"GPU allocation (% of capacity) on `{trace}`, median over {len(seeds)} seed(s) "
        f"({', '.join(map(str, seeds))}); the paper's value in brackets.",
        "",
        "| policy | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(head),
    ]
    for policy, row in medians(runs).items():
        cells = []
        for a in ARRIVALS:
            ours = _cell(row.get(a)) or "-"
            theirs = paper.get(policy, {}).get(a)
            cells.append(ours if theirs is None else f"{ours} ({theirs:.2f})")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path, trace: str, runs: Sequence[Run]) -> None:
    """Allocation against arrival, one line per policy (medians over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for policy, row in medians(runs).items():
        points = [(b, v) for b, v in row.items() if v is not None]
        axes.plot([b for b, _ in points], [v for _, v in points], label=policy, linewidth=1.2)
    axes.set_xlabel("arrived workload (% of GPU capacity)")
    axes.set_ylabel("GPU allocated (% of capacity)")
    axes.set_title(f"{trace}: allocation by policy")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    low = min((v for row in medians(runs).values() for v in row.values() if v is not None), default=0)
    axes.set_ylim(max(low, 50), 100)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def progress_bar(total: int, write: Callable[[str], object]) -> Callable[[str], None]:
    """A text progress bar over ``total`` runs; call the result with a note after each run."""
    done = [0]

    def step(note: str) -> None:
        done[0] += 1
        width = 30
        filled = width * done[0] // total
        write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done[0]}/{total} {note:<40}")
        if done[0] == total:
            write("\n")

    return step
