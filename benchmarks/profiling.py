"""Sampling a running component with py-spy, and the top of what it saw.

py-spy reads the target's memory from outside, so the profiled process runs unmodified; ``--nonblocking``
keeps it from pausing the target at each sample (the figures are then slightly noisier, not slower).
Only the thread holding the GIL is sampled (``--gil``): a Python process runs one thread at a time, so
what holds the GIL is what every request waits for, and threads waiting on sockets don't count.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

#: "function (path/to/file.py:123)" as py-spy's raw (collapsed) format writes a frame
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


@contextlib.contextmanager
def sampled(pid: int, out: Path, rate: int = 200) -> Iterator[None]:
    """py-spy samples ``pid`` (its non-idle threads) into ``out`` while the block runs."""
    # the one the `bench` extra put beside this Python (a venv's bin, which needn't be on PATH)
    beside = Path(sys.executable).with_name("py-spy")
    spy = str(beside) if os.access(beside, os.X_OK) else shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    proc = subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--nonblocking",
            "--gil",
            "--format",
            "raw",
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    if not out.exists():
        raise RuntimeError(f"py-spy wrote no profile of pid {pid}: {err.decode(errors='replace')[-400:]}")


def _frame(text: str) -> str:
    match = _FRAME.match(text)
    if match is None:
        return text
    return f"{match['function']} ({os.path.basename(match['file'])})"


def top(profile: Path, count: int = 15) -> str:
    """The ``count`` frames with the most samples of their own, and those with the most samples below
    them (each counted once per stack), as percentages of all samples."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in profile.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        n = int(samples)
        total += n
        frames = [_frame(f) for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    if not total:
        return f"{profile}: no samples"
    lines = [f"{profile.name}: {total} samples", "  own  below  frame"]
    for frame, n in own.most_common(count):
        lines.append(f"{100 * n / total:5.1f}% {100 * inclusive[frame] / total:5.1f}%  {frame}")
    lines.append("  most samples below (inclusive):")
    for frame, n in inclusive.most_common(count):
        lines.append(f"       {100 * n / total:5.1f}%  {frame}")
    return "\n".join(lines)
