"""``gpushare simulate``: replay a cluster's pods under placement policies and report the GPU allocation."""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DEFAULT_SEEDS = "42-51"


def parse_seeds(text: str) -> list[int]:
    """``42-51,60`` -> 42..51 and 60."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            seeds.extend(range(int(low), int(high or low) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"seeds must look like 42-51 or 1,5,9, not {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=Path, help="nodes CSV (sn,cpu_milli,memory_mib,gpu,model)")
    parser.add_argument("--pods", type=Path, help="pods CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec])")
    parser.add_argument("--from-cluster", action="store_true", help="snapshot the live cluster into the two CSVs")
    parser.add_argument("--kubeconfig", default=None, help="with --from-cluster; default: in-cluster, ~/.kube/config")
    parser.add_argument(
        "--policy", action="append", help="repeatable; 'default' is the extender's default (default: all)"
    )
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds(DEFAULT_SEEDS), help="default: 42-51")
    parser.add_argument("--out", type=Path, default=Path("simulate-out"), help="output directory")
    parser.add_argument("--workers", type=int, default=1, help="runs in parallel (processes)")


def run(args: argparse.Namespace) -> int:
    from gpushare.settings import UsageError
    from gpushare.simulate import report
    from gpushare.simulate.trace import TraceError, load_nodes, load_pods

    known = report.policy_names()
    policies = args.policy or known
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise UsageError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.workers < 1:
        raise UsageError("--workers must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_cluster:
        if args.nodes or args.pods:
            raise UsageError("--from-cluster writes its own CSVs: give it without --nodes/--pods")
        from gpushare.kube.transport import load_api
        from gpushare.simulate.snapshot import snapshot

        args.nodes, args.pods = snapshot(load_api(args.kubeconfig), args.out)
        print(f"gpushare simulate: cluster snapshot in {args.nodes} and {args.pods}", file=sys.stderr)
    elif not (args.nodes and args.pods):
        raise UsageError("give --nodes and --pods, or --from-cluster")
    try:
        nodes, pods = load_nodes(args.nodes), load_pods(args.pods)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    trace = args.pods.stem
    jobs = [(p, s) for p in policies for s in args.seeds]
    step = report.progress_bar(len(jobs), sys.stderr.write)
    runs = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(report.run_one, trace, nodes, pods, p, s) for p, s in jobs]
        for future in futures:
            result = future.result()
            step(f"{result.policy} seed {result.seed}")
            runs.append(result)
    report.write_results(args.out / "results.csv", runs)
    table = report.markdown(trace, runs, report.paper_medians(args.pods, trace))
    (args.out / "summary.md").write_text(table)
    report.plot(args.out / "allocation.png", trace, runs)
    print(table)
    print(f"wrote {args.out / 'results.csv'}, {args.out / 'summary.md'} and {args.out / 'allocation.png'}")
    return 0
