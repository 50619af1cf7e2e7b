"""Launching the real cluster's processes on this machine: each child in its own session with its log in
the cluster's directory, remembered in start order so that one stop ends them all, and the loopback
probes that tell when one is up."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.process import end_group

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The cluster could not come up; the message names the part and its log."""


def log_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a component's log, for an error message ("" if it can't be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll until ``predicate`` returns something truthy; :class:`ClusterError` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def loopback_get(url: str, token: str = "", timeout: float = 1.0) -> Any:
    """The open reply to a GET of a component on loopback, with ``token`` as its bearer token when
    given; certificates are not checked (loopback, self-signed)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    return urllib.request.urlopen(request, timeout=timeout, context=context)


def http_status(url: str, token: str = "", timeout: float = 1.0) -> int:
    """HTTP(S) status of a GET (:func:`loopback_get`), 0 when nothing answers."""
    try:
        with loopback_get(url, token, timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


class Process:
    """One child in its own session, logging to a file; stopped with SIGTERM then SIGKILL to its group."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> None:
        """``log_path``'s directory is also the working directory; ``env`` replaces the inherited environment."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with self.log_path.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.log_path.parent,
                env=self.env,
            )
        log.info("started %s (pid %d), log %s", self.name, self.popen.pid, self.log_path)
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else 0

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def check(self) -> None:
        """:class:`ClusterError` with the log's tail if the process has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            raise ClusterError(
                f"{self.name} exited with {self.popen.returncode}; {self.log_path}:\n{log_tail(self.log_path, 15)}"
            )

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        end_group(self.popen, timeout)
        log.info("stopped %s (pid %d)", self.name, self.popen.pid)


@dataclass
class Launcher:
    """Starts the cluster's processes, each logging to ``workdir``/NAME.log, and keeps them in start order
    (:attr:`processes`) until they are stopped."""

    workdir: Path
    processes: list[Process] = field(default_factory=list)

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Process:
        proc = Process(name, argv, self.workdir / f"{name}.log", env).start()
        self.processes.append(proc)
        return proc

    def stop(self, proc: Process) -> None:
        """Stop one process and forget it (to start another in its place)."""
        proc.stop()
        self.processes.remove(proc)


def processes_using(path: Path) -> list[int]:
    """Processes whose command line, working directory, root or mount table lies under ``path``: every
    process a cluster in that directory started, container processes included, even one whose shim is
    gone (it shows its root inside its node's mount namespace, but its mounts name the snapshot here)."""
    inside = str(path).encode() + b"/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
            places = [os.readlink(entry / "cwd").encode(), os.readlink(entry / "root").encode()]
            mounts = (entry / "mountinfo").read_bytes()
        except OSError:
            continue
        if inside in argv or inside in mounts or any((p + b"/").startswith(inside) for p in places):
            found.append(int(entry.name))
    return found
