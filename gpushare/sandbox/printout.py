"""What ``gpushare sandbox`` prints, on the stand-ins and on a real Kubernetes alike: a line per start-up
step, then each example pod's fate, the per-card allocation and every GPU container's env."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.cards import Card
from gpushare.contract.names import ENV_MEM_CONTAINER, ENV_MEM_DEV, ENV_MEM_IDX, ENV_MEM_POD, ENV_VISIBLE_DEVICES
from gpushare.inspection.render import render_table
from gpushare.process import Terminated, signals_ignored

GPU_ENV = (ENV_VISIBLE_DEVICES, ENV_MEM_IDX, ENV_MEM_POD, ENV_MEM_CONTAINER, ENV_MEM_DEV)
#: unix socket paths end at 107 bytes, and the real cluster's sit three levels below the run directory
MAX_TEMP_ROOT = 30
KEEP_RUNNING_HINT = "The cluster is stopped again; gpushare sandbox --keep-running keeps it up for kubectl."


class Progress:
    """One line per start-up step on stderr, with its duration."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self._total = total
        self._done = 0
        self._stream = stream

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self._done += 1
        prefix = f"[{self._done}/{self._total}] {what}"
        self._stream.write(f"{prefix} ...")
        self._stream.flush()
        began = time.monotonic()
        try:
            yield
        except (KeyboardInterrupt, Terminated):
            self._stream.write(" interrupted\n")
            raise
        except BaseException:
            self._stream.write(" failed\n")
            raise
        self._stream.write(f" done ({time.monotonic() - began:.1f}s)\n")
        self._stream.flush()


@dataclass
class PodOutcome:
    name: str
    node: str = ""
    state: str = "Pending"
    reason: str = ""
    cards: str = ""
    #: container -> its GPU env, and where it was read from
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    env_source: str = ""
    #: container -> the GPU memory limits the driver holds its pod to (on the real cluster)
    limits: dict[str, str] = field(default_factory=dict)


def cards_of(pod: Mapping[str, Any], cards: Iterable[Card]) -> str:
    """The pod's cards per container, for the report."""
    from gpushare.holdings.pod import pod_allocation

    allocation = pod_allocation(pod, list(cards)) or {}
    return "; ".join(
        f"{name}: " + ",".join(f"card {s.index} ({s.units} GiB)" for s in slices)
        for name, slices in sorted(allocation.items())
    )


class RunDir:
    """The run's temporary directory, with the sandbox's own log in it, as a context manager. On the way
    out, however it is left (a signal, Ctrl-C, an error), it calls what :meth:`on_exit` registered (stopping
    the cluster) with signals held off, then removes the directory, or, after a failed run, all of it
    but the logs, and says where they are. A run has failed when :attr:`failed` was set or an error
    other than a stop request escaped."""

    def __init__(self, err: Any = sys.stderr) -> None:
        root = tempfile.gettempdir()
        self.path = Path(
            tempfile.mkdtemp(prefix="gpushare-sandbox-", dir=root if len(root) <= MAX_TEMP_ROOT else "/tmp")
        )
        self.failed = False
        self._err = err
        self._log = log_to(self.path / "sandbox.log")
        self._on_exit: list[Callable[[], None]] = []

    def on_exit(self, stop: Callable[[], None]) -> None:
        self._on_exit.append(stop)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        failed = self.failed or (kind is not None and not issubclass(kind, (Terminated, KeyboardInterrupt)))
        with signals_ignored():
            for stop in reversed(self._on_exit):
                stop()
            logging.getLogger().removeHandler(self._log)
            self._log.close()
            if not failed:
                shutil.rmtree(self.path, ignore_errors=True)
                return
            keep_only_logs(self.path)
            print(f"gpushare sandbox: the components' logs are kept in {self.path}", file=self._err)


def keep_only_logs(directory: Path) -> None:
    """Delete every file under ``directory`` not named ``*.log``, then the directories left empty.
    Symbolic links are removed, never followed."""
    for root, dirs, files in os.walk(directory, topdown=False):
        for name in files:
            if not name.endswith(".log"):
                (Path(root) / name).unlink(missing_ok=True)
        for name in dirs:
            path = Path(root) / name
            with contextlib.suppress(OSError):  # a directory still holding logs stays
                path.unlink() if path.is_symlink() else path.rmdir()


def log_to(path: Path) -> logging.Handler:
    """Component logs go to a file; the terminal keeps the progress lines, warnings and the report."""
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setLevel(logging.ERROR)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)
    return file_handler


def render_pods(outcomes: Sequence[PodOutcome]) -> str:
    rows = [["POD", "NODE", "CARDS", "STATE", "REASON"]]
    rows += [[o.name, o.node or "-", o.cards or "-", o.state, o.reason or "-"] for o in outcomes]
    return render_table(rows)


def render_env(outcomes: Sequence[PodOutcome]) -> str:
    """Each container's GPU env, and beside it the memory limits the driver holds its pod to."""
    rows = [["POD", "CONTAINER", *GPU_ENV, "POD'S GPU MEMORY LIMIT"]]
    for o in outcomes:
        for container, env in sorted(o.env.items()):
            rows.append([o.name, container, *(_short(env.get(k, "-")) for k in GPU_ENV), o.limits.get(container, "-")])
    return render_table(rows)


def _short(value: str) -> str:
    """Card UUIDs are long; the first block is enough to tell them apart in a table."""
    return ",".join(v[:12] if v.startswith("GPU-") else v for v in value.split(","))


def report(outcomes: Sequence[PodOutcome], policy: str, started: float, inspect: str, note: str, out: Any) -> None:
    print(f"\nPods (policy {policy}; {time.monotonic() - started:.1f}s from start)\n", file=out)
    print(render_pods(outcomes), file=out)
    print("\nPer-card allocation (gpushare inspect -d)\n", file=out)
    print(inspect, file=out)
    print(f"\nGPU environment of each container ({note})\n", file=out)
    print(render_env(outcomes), file=out)


def render_endpoints(endpoints: Sequence[tuple[str, str]]) -> str:
    """One line per component: its name and where it answers."""
    return render_table([["COMPONENT", "ENDPOINTS"], *([name, where] for name, where in endpoints)])


def stay_up(hints: str, out: Any) -> None:
    """Until Ctrl-C, which is how it is meant to end (SIGTERM and SIGHUP raise past it)."""
    with contextlib.suppress(KeyboardInterrupt):
        print(f"\nRunning. Try: {hints}\nCtrl-C to stop.", file=out, flush=True)
        while True:
            time.sleep(3600)
