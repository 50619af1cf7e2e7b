"""``gpushare simulate``: replay a cluster's pods under placement policies and report the GPU allocation."""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DEFAULT_SEEDS = "42-51"
#: the most runs per policy; each takes seconds on a large trace
MAX_SEEDS = 1000
PLOT_HINT = "pip install 'gpushare[simulate]'"


def parse_seeds(text: str) -> list[int]:
    """``42-51,60`` -> 42..51 and 60, at most MAX_SEEDS of them."""
    ranges: list[range] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            ranges.append(range(int(low), int(high or low) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"seeds must look like 42-51 or 1,5,9, not {text!r}") from None
        if sum(map(len, ranges)) > MAX_SEEDS:
            raise argparse.ArgumentTypeError(f"{text!r} gives more than {MAX_SEEDS} seeds")
    seeds = [seed for r in ranges for seed in r]
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gpushare.placement import DEFAULT_POLICY

    parser.add_argument("--nodes", type=Path, help="nodes CSV (sn,cpu_milli,memory_mib,gpu,model)")
    parser.add_argument("--pods", type=Path, help="pods CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec])")
    parser.add_argument("--from-cluster", action="store_true", help="snapshot the live cluster into the two CSVs")
    parser.add_argument(
        "--kubeconfig",
        default=None,
        metavar="FILE",
        help="with --from-cluster; default: the in-cluster configuration, then $KUBECONFIG or ~/.kube/config",
    )
    parser.add_argument(
        "--policy",
        action="append",
        help=f"repeatable; 'default' is the extender's default policy, {DEFAULT_POLICY}, under that name "
        f"(default: every policy once, the extender's default as {DEFAULT_POLICY})",
    )
    parser.add_argument(
        "--seeds",
        type=parse_seeds,
        default=DEFAULT_SEEDS,
        help=f"one run per seed and policy, at most {MAX_SEEDS} seeds (default: %(default)s)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("simulate-out"), help="output directory (default: %(default)s)"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="runs in parallel, one process each (default: %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from gpushare.settings import UsageError
    from gpushare.simulate import report, runs
    from gpushare.simulate.trace import TraceError, load_nodes, load_pods, unknown_models

    known = runs.policy_names()
    unknown = [p for p in args.policy or () if p not in known]
    if unknown:
        raise UsageError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.workers < 1:
        raise UsageError("--workers must be at least 1")
    policies = runs.policies_to_run(args.policy)
    if not args.from_cluster and not (args.nodes and args.pods):
        raise UsageError("give --nodes and --pods, or --from-cluster")
    if args.from_cluster and (args.nodes or args.pods):
        raise UsageError("--from-cluster writes its own CSVs: give it without --nodes/--pods")
    can_plot = report.can_plot()
    if not can_plot:
        print(f"gpushare simulate: matplotlib is missing, so no plot; {PLOT_HINT} draws it", file=sys.stderr)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: {exc.strerror}") from None
    if args.from_cluster:
        from gpushare.kube.transport import load_api
        from gpushare.simulate.snapshot import snapshot

        taken = snapshot(load_api(args.kubeconfig), args.out)
        args.nodes, args.pods = taken.nodes_csv, taken.pods_csv
        print(f"gpushare simulate: {taken.summary()}", file=sys.stderr)
    try:
        nodes, pods = load_nodes(args.nodes), load_pods(args.pods)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    for warning in unknown_models(args.pods, pods, nodes):
        print(f"gpushare simulate: warning: {warning}", file=sys.stderr)
    trace = args.pods.stem
    jobs = [(p, s) for p in policies for s in args.seeds]
    print(
        f"gpushare simulate: {len(jobs)} run(s), {len(policies)} policy(ies) x {len(args.seeds)} seed(s), "
        f"{args.workers} at a time",
        file=sys.stderr,
    )
    results = []
    with (
        ProcessPoolExecutor(max_workers=args.workers) as pool,
        tqdm(total=len(jobs), unit="run", file=sys.stderr, disable=None) as bar,
    ):
        futures = [pool.submit(runs.run_one, trace, nodes, pods, p, s) for p, s in jobs]
        try:
            for future in futures:
                result = future.result()
                bar.set_postfix_str(f"{result.policy} seed {result.seed}")
                bar.update()
                results.append(result)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    table = report.markdown(trace, results, report.paper_medians(args.pods, trace))
    written = [args.out / "results.csv", args.out / "summary.md"]
    try:
        report.write_results(written[0], results)
        written[1].write_text(table)
        if can_plot:
            written.append(args.out / "allocation.png")
            report.plot(written[-1], trace, results)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: {exc.strerror}") from None
    print(table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0
