"""``gpushare simulate`` on one of the openb traces, named by its variant (reference: Weng et al., "Beware of
Fragmentation", USENIX ATC'23; the files and the paper's medians are in TRACE_DIR).

    python benchmarks/trace_replay.py --trace default --seeds 42-51 --workers 2 [--policy NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpushare.cli import main as gpushare

TRACE_DIR = Path("/work/shared/traces/openb")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="default", help="default, gpushare40, cpu250, ...")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    args, rest = parser.parse_known_args(argv)
    nodes = args.trace_dir / "openb_node_list_gpu_node.csv"
    pods = args.trace_dir / f"openb_pod_list_{args.trace}.csv"
    return gpushare(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--out", f"simulate-{args.trace}", *rest])


if __name__ == "__main__":
    sys.exit(main())
