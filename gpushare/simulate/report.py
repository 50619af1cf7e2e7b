"""Writing what replays found (:class:`~gpushare.simulate.runs.Run`): results.csv (one row per run), a
Markdown table of the medians over seeds (with the FGD paper's published values beside its baselines for
openb traces) and a plot of allocation against arrival per policy, like the paper's Figure 9."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare.simulate.baselines import PAPER_NAMES
from gpushare.simulate.replay import ARRIVALS
from gpushare.simulate.runs import PAPER_PREFIX, Run

#: the paper's published medians, looked for next to the pods file
PAPER_FILE = "paper_alloc_medians.csv"
RESULT_COLUMNS = ("trace", "policy", "seed", *(f"alloc{a}" for a in ARRIVALS))


def _row(run: Run) -> list[str]:
    return [run.trace, run.policy, str(run.seed), *(_cell(run.at(a)) for a in ARRIVALS)]


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def write_results(path: Path, runs: Sequence[Run]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(RESULT_COLUMNS)
        writer.writerows(_row(run) for run in runs)


@dataclass(frozen=True, slots=True)
class Median:
    """The median over the seeds that reached a mark, and how many did out of how many."""

    value: float | None
    seeds: int
    of: int


def median_at(runs: Sequence[Run], mark: int) -> Median:
    values = [v for r in runs if (v := r.at(mark)) is not None]
    return Median(statistics.median(values) if values else None, len(values), len(runs))


def by_policy(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs of each policy, policies in the order they ran."""
    return {policy: [r for r in runs if r.policy == policy] for policy in dict.fromkeys(r.policy for r in runs)}


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


def _median_cell(median: Median, paper: float | None) -> str:
    cell = "-" if median.value is None else f"{median.value:.2f}"
    if median.value is not None and median.seeds < median.of:
        cell += f" ({median.seeds} of {median.of} seeds)"
    return cell if paper is None else f"{cell} ({paper:.2f})"


def markdown(trace: str, runs: Sequence[Run], paper: dict[str, dict[int, float]]) -> str:
    """The medians per policy and mark, with the paper's values where there are some, and notes on the
    marks that could not be read exactly."""
    seeds = sorted({r.seed for r in runs})
    groups = by_policy(runs)
    shown = {p: paper[p] for p in groups if p in paper}
    head = [f"alloc @ {a}% arrived" for a in ARRIVALS]
    lines = [
        f"GPU allocation (% of capacity) on `{trace}`, median over {len(seeds)} seed(s) "
        f"({', '.join(map(str, seeds))})" + ("; the paper's value in brackets." if shown else "."),
        "",
        "| policy | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(head),
    ]
    for policy, mine in groups.items():
        cells = [_median_cell(median_at(mine, a), shown.get(policy, {}).get(a)) for a in ARRIVALS]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + "".join(f"\n{note}\n" for note in notes(runs))


def notes(runs: Sequence[Run]) -> list[str]:
    """Why some cells are not plain medians: marks the arrivals jumped over or never reached."""
    found = []
    skipped = sorted({a for r in runs for a in ARRIVALS if r.skipped(a)})
    if skipped:
        found.append(
            f"Each pod is a large share of this cluster's GPUs, so some runs' arrivals jumped over the "
            f"{', '.join(f'{a}%' for a in skipped)} mark(s): there, a run counts the allocation after the last "
            "pod that arrived before the mark."
        )
    short = [r.reached for r in runs if any(r.at(a) is None for a in ARRIVALS)]
    if short:
        found.append(
            f"`-` or fewer seeds: some runs' arrivals stopped at {min(short)}-{max(short)}% of the GPU capacity "
            f"(arrivals stop before the pod that would pass {ARRIVALS[-1]}%), so they have no value at the later "
            "mark(s); the median is over the seeds that reached the mark."
        )
    return found


#: one colour per policy (the extender's drawn solid, the paper's baselines dashed)
COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#6b3fa0",
)  # fmt: skip


def can_plot() -> bool:
    """Whether matplotlib, which draws the plot, is installed (the ``simulate`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: Path, trace: str, runs: Sequence[Run]) -> None:
    """Allocation against arrived workload, both from 0, as in the FGD paper's Figure 9: one line per
    policy (the median over seeds) in its own colour, a band from the lowest to the highest seed,
    markers at the table's marks, and an inset zooming in on the marks."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(10, 6))
    # above the diagonal, where no line goes: a run never allocates more than has arrived
    inset = axes.inset_axes((0.05, 0.54, 0.32, 0.42))
    lowest = 100.0
    for (policy, mine), colour in zip(by_policy(runs).items(), COLOURS * 2, strict=False):
        xs = list(range(max(r.reached for r in mine) + 1))
        seeds = [[v for r in mine if (v := r.at(x)) is not None] for x in xs]
        middle = [statistics.median(values) for values in seeds]
        marks = [(a, m.value) for a in ARRIVALS if (m := median_at(mine, a)).value is not None]
        style = "--" if policy.startswith(PAPER_PREFIX) else "-"
        for ax in (axes, inset):
            ax.plot(xs, middle, style, color=colour, linewidth=1.4, label=policy if ax is axes else None)
            ax.fill_between(xs, [min(v) for v in seeds], [max(v) for v in seeds], color=colour, alpha=0.1, lw=0)
            ax.plot([a for a, _ in marks], [v for _, v in marks], "o", color=colour, markersize=4)
        lowest = min([lowest, *(v for _, v in marks)])
    for ax in (axes, inset):
        for a in ARRIVALS:
            ax.axvline(a, color="grey", linewidth=0.6, linestyle=":")
        ax.grid(True, alpha=0.3)
    axes.plot([0, 100], [0, 100], color="grey", linewidth=0.6, linestyle=":")
    axes.set_xlim(0, ARRIVALS[-1] + 2)
    axes.set_ylim(0, 100)
    axes.set_xlabel("arrived workload (% of GPU capacity)")
    axes.set_ylabel("GPU allocation (% of capacity)")
    axes.set_title(f"{trace}: GPU allocation by policy")
    axes.legend(
        fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), title="median of seeds\n(band: lowest to highest)"
    )
    inset.set_xlim(ARRIVALS[0] - 5, ARRIVALS[-1] + 2)
    inset.set_ylim(max(0.0, lowest - 2), 100)
    inset.tick_params(labelsize=7)
    axes.indicate_inset_zoom(inset, edgecolor="grey")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
