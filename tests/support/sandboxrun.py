"""``gpushare sandbox`` as a child process in a temporary directory of its own ($TMPDIR), watched
through what it prints, and what a run may leave behind on this machine once it has exited."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from gpushare.sandbox.launch import processes_using

NET = Path("/sys/class/net")


class Output:
    """Everything a pipe delivers, kept as it arrives so a test can wait for a piece of it."""

    def __init__(self, pipe: int) -> None:
        self._text = ""
        self._closed = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: int) -> None:
        while chunk := os.read(pipe, 65536):
            with self._changed:
                self._text += chunk.decode(errors="replace")
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def text(self) -> str:
        with self._changed:
            return self._text

    def wait_for(self, piece: str, timeout: float) -> str:
        """All the text so far once ``piece`` is in it; the test fails if the pipe closes or ``timeout``
        passes first."""
        with self._changed:
            self._changed.wait_for(lambda: piece in self._text or self._closed, timeout)
            if piece not in self._text:
                raise AssertionError(f"{piece!r} never appeared; got:\n{self._text[-3000:]}")
            return self._text

    def wait_closed(self, timeout: float) -> str:
        with self._changed:
            self._changed.wait_for(lambda: self._closed, timeout)
            return self._text


class SandboxRun:
    """One ``gpushare sandbox`` process whose temporary directory is ``root``; with ``sigint_ignored`` it
    starts with SIGINT ignored, as a job started with ``cmd &`` from a script does."""

    def __init__(
        self, root: Path, *flags: str, env: Mapping[str, str] | None = None, sigint_ignored: bool = False
    ) -> None:
        self.root = root
        command = [sys.executable, "-m", "gpushare.cli", "sandbox", *flags]
        if sigint_ignored:  # an ignored signal stays ignored across exec
            command = ["sh", "-c", 'trap "" INT && exec "$@"', "sh", *command]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {}), "TMPDIR": str(root)},
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out = Output(self.proc.stdout.fileno())
        self.err = Output(self.proc.stderr.fileno())

    @property
    def workdir(self) -> Path:
        """The run directory it made in ``root``."""
        (found,) = self.root.glob("gpushare-sandbox-*")
        return found

    def printed(self, piece: str, timeout: float) -> str:
        """All it printed once ``piece`` is in it; a failure also says whether it exited and what it
        wrote on stderr (where its progress and its errors go)."""
        try:
            return self.out.wait_for(piece, timeout)
        except AssertionError as exc:
            why = f"{exc}\nexit status: {self.proc.poll()}\nstderr:\n{self.err.text[-3000:]}"
            raise AssertionError(why) from None

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout)
        self.out.wait_closed(10)
        self.err.wait_closed(10)
        return code

    def kill(self) -> None:
        """The test's own clean-up after a failure: SIGTERM, then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bridges_and_ports(names: list[str]) -> set[str]:
    """Those of the bridges ``names`` that exist, and the veths attached to them."""
    found = set()
    for name in names:
        if (NET / name).exists():
            found.add(name)
            found |= {port.name for port in (NET / name / "brif").glob("*")}
    return found


def leftovers(root: Path, interfaces: set[str] = frozenset()) -> list[str]:
    """What a sandbox that ran under ``root`` left: processes, mounts in any mount namespace (a
    namespace a process still holds shows in that process's mountinfo), network interfaces among
    ``interfaces``, iptables rules naming them, and files."""
    left = [f"process {pid}: {_cmdline(pid)}" for pid in processes_using(root)]
    inside = str(root)
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            mounts = (entry / "mountinfo").read_text()
        except OSError:
            continue
        left += [f"mount seen by pid {entry.name}: {line}" for line in mounts.splitlines() if inside in line]
    left += [f"interface {name}" for name in sorted(interfaces) if (NET / name).exists()]
    if interfaces and shutil.which("iptables-save"):
        rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=False).stdout
        left += [f"iptables: {line}" for line in rules.splitlines() if any(name in line for name in interfaces)]
    left += [f"file {path}" for path in root.rglob("*")]
    return left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


@contextlib.contextmanager
def kept_running(*args: str) -> Iterator[SandboxRun]:
    """``gpushare sandbox --keep-running ARGS`` up (its cluster ready) for the block, then stopped with
    SIGTERM and its directory removed."""
    root = Path(tempfile.mkdtemp(prefix="gs-t", dir="/tmp"))  # the sandbox's socket paths must stay short
    run = SandboxRun(root, "--keep-running", *args)
    try:
        run.printed("Ctrl-C", 240)
        yield run
    finally:
        run.signal(signal.SIGTERM)
        run.wait()
        run.kill()
        shutil.rmtree(root, ignore_errors=True)


def kubeconfig(run: SandboxRun) -> str:
    """The kubeconfig a kept-running sandbox told its user to use."""
    found = re.search(r"kubectl --kubeconfig (\S+) get pods", run.out.text)
    assert found, run.out.text[-2000:]
    return found.group(1)
