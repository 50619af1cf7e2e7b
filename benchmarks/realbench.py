"""The real cluster as the benchmarks use it: checked for, started in a temporary directory of its own,
and stopped with that directory removed (or kept for its logs) however the benchmark ends."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gpushare.sandbox.realcluster import RealCluster, realcluster_available, running_cluster


@contextlib.contextmanager
def real_cluster(
    prefix: str, nodes: Sequence[tuple[str, str]], keep: bool = False, **options: Any
) -> Iterator[RealCluster]:
    """A started :class:`RealCluster` of ``nodes``; exits with status 2 and the reason when none can run here."""
    if reason := realcluster_available():
        print(f"needs a real cluster: {reason}", file=sys.stderr)
        raise SystemExit(2)
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        with running_cluster(nodes, workdir, **options) as cluster:
            yield cluster
    finally:
        if keep:
            print(f"logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
