"""The node agent's side of the detached CRI shim (:mod:`gpushare.crishim.detached`): adopt the shim that
serves the socket, or start one and let it take the socket over.

An agent that starts finds one of three things beside the socket:

- no live shim (a first start, or the shim's supervisor was killed too): it starts one;
- a live shim with its own fingerprint (same code, same settings, same pod: the agent's container was
  restarted, after an OOM kill say): it adopts it, and there is still one shim;
- a live shim with another fingerprint (a new image or new flags: a rolling upgrade): it starts a new
  one, which binds a private socket and renames it over the path (rename(2) replaces it in one step, so
  every connection kubelet opens reaches one shim or the other), then tells the old one to drain: it
  sends each kubelet connection a GOAWAY, so kubelet's gRPC client opens its next calls on a new
  connection, which reaches the new shim, and exits once the calls under way have finished.

Starts are serialized by a lock file beside the socket, so two agents never start two shims at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import logging
import os
import pickle
import select
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpushare.crishim.detached import (
    FAILED,
    READY,
    WORKER_START_SECONDS,
    DetachedConfig,
    DetachError,
    Record,
    ShimHome,
    rotate_log,
)

from gpushare.contract.names import ENV_POD_UID
from gpushare.settings import NodeSettings, ShimSettings, socket_path

log = logging.getLogger(__name__)

#: the packages whose code a shim runs (their folders, as installed): a change in any is a new shim
CODE_PACKAGES = ("gpushare", "gpushare.crishim")


def code_digest() -> str:
    """A digest of the Python sources of :data:`CODE_PACKAGES`: what tells a new image's shim from an old one."""
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        folder = Path(importlib.import_module(package).__file__ or "").parent
        for source in sorted(folder.rglob("*.py")):
            digest.update(str(source.relative_to(folder)).encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def fingerprint(node: NodeSettings, shim: ShimSettings) -> str:
    """The shim's code, its settings and the pod that starts it (its API token is that pod's, bound to it
    and refused once the pod is deleted, so a new pod's agent starts a shim of its own)."""
    what = f"{code_digest()}\n{node!r}\n{shim!r}\n{os.environ.get(ENV_POD_UID, '')}"
    return hashlib.sha256(what.encode()).hexdigest()


@dataclass
class DetachedShim:
    """The agent's handle on the detached shim, as a supervised component (:mod:`gpushare.supervisor`)."""

    home: ShimHome
    record: Record
    #: True when this agent found the shim already serving
    adopted: bool

    def alive(self) -> bool:
        """A detached shim serves the socket (this one, or one a newer agent started)."""
        return self.home.live() is not None

    def ready(self) -> bool:
        with contextlib.suppress(FileNotFoundError):
            return self.alive() and stat.S_ISSOCK(self.home.socket.lstat().st_mode)
        return False

    def stop(self) -> None:
        """Leaves the shim serving: kubelet needs it while the agent is away, restarted or upgraded."""


def start_detached_shim(
    node: NodeSettings,
    shim: ShimSettings,
    cgroup_root: Path,
    drain_seconds: float = 30.0,
    escape_below: int | None = None,
) -> DetachedShim:
    """Adopt the shim serving ``shim.listen`` if it is this agent's own kind, else start one (which
    takes the socket over from any other); see the module's docstring. ``cgroup_root``: where the host's
    cgroup hierarchies are mounted (:func:`gpushare.crishim.detached.escape_cgroups`)."""
    home = ShimHome(socket_path(shim.listen))
    home.socket.parent.mkdir(parents=True, exist_ok=True)
    mine = fingerprint(node, shim)
    with _locked(home.lock_path):
        current = home.live()
        if current is not None and current.fingerprint == mine:
            log.info("CRI shim supervisor %d already serves %s: adopted", current.supervisor.pid, shim.listen)
            return DetachedShim(home, current, adopted=True)
        replaces = current.supervisor if current is not None else None
        config = DetachedConfig(node, shim, mine, cgroup_root, replaces, drain_seconds, escape_below)
        _spawn(home, config)
        record = home.live()
        if record is None or record.fingerprint != mine:
            raise DetachError(f"the detached CRI shim said it serves but its record is missing; see {home.log_path}")
        how = f"taking over from supervisor {replaces.pid}" if replaces is not None else "none was running"
        log.info("CRI shim supervisor %d serves %s (%s)", record.supervisor.pid, shim.listen, how)
        return DetachedShim(home, record, adopted=False)


def _spawn(home: ShimHome, config: DetachedConfig) -> None:
    """Start ``python -m gpushare.crishim.detached`` and wait for its word that it serves."""
    rotate_log(home.log_path)
    with open(home.log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpushare.crishim.detached"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            start_new_session=True,
        )
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(pickle.dumps(config))
        process.stdin.close()
        answer = _first_line(process.stdout.fileno(), WORKER_START_SECONDS + 10)
    finally:
        process.stdout.close()
        process.wait()  # it forks the supervisor and exits at once
    if answer != READY:
        why = "it failed to start" if answer == FAILED else "it said nothing in time"
        raise DetachError(f"the detached CRI shim for {config.shim.listen} is not serving ({why}); see {home.log_path}")


def _first_line(fd: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    got = b""
    while not got.endswith(b"\n") and (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([fd], [], [], left)
        chunk = os.read(fd, 64) if readable else b""
        if not chunk:
            break
        got += chunk
    return got


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
