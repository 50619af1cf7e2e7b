"""Process-level helpers for the long-running commands."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

#: the signals that ask a command to stop: kill's default, a closed terminal and Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def end_group(popen: subprocess.Popen[Any], timeout: float) -> None:
    """End the process group ``popen`` leads (started with ``start_new_session``): SIGTERM, then SIGKILL
    after ``timeout`` seconds; returns once ``popen`` has exited."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGTERM)
    try:
        popen.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()


def interrupt_on_sigint() -> None:
    """Make SIGINT raise KeyboardInterrupt, explicitly: Python installs that handler only when SIGINT was
    not ignored at start (the signal module's documentation), and a job started with ``cmd &`` from a
    script inherits it ignored, so Ctrl-C and ``kill -INT`` would do nothing. Outside the main thread
    (where handlers can't be set) it does nothing."""
    if _main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def wait_for_termination() -> None:
    """Block until SIGTERM (how Kubernetes stops a pod) or SIGINT, whether or not SIGINT was inherited
    ignored."""
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    stopping.wait()


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the main thread is, so that every ``finally`` on the way out runs.

    A BaseException, as KeyboardInterrupt is, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_raise(signums: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Within, each of ``signums`` raises :class:`Terminated` (Python's default for them ends the process
    at once, skipping all clean-up); Ctrl-C raises KeyboardInterrupt, even where SIGINT was inherited
    ignored (see :func:`interrupt_on_sigint`)."""

    def terminate(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    previous = {signum: signal.signal(signum, terminate) for signum in signums}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_ignored(signums: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Within, ``signums`` are ignored: a clean-up that a second Ctrl-C or kill interrupted would leave
    half of what it stops running. Outside the main thread (where handlers can't be set) it does nothing."""
    if not _main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
