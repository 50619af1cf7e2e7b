"""The CRI shim as a process of its own that outlives the node agent's container.

Kubelet reaches its container runtime only through the shim's socket, so a shim that dies with the agent
leaves kubelet unable to start any container, the agent's included: the node stays NotReady until a
person steps in. Here the shim is a small supervisor (this module run as ``python -m``) that restarts its
worker, a forked process serving :func:`gpushare.crishim.wiring.start_cri_shim`, when the worker dies.
The supervisor leaves the agent's container before it serves:

- its cgroup: when a container shares the host's PID namespace, containerd's runc shim kills all its
  processes once its init exits (``ShouldKillAllOnExit``, cmd/containerd-shim-runc-v2/runc/util.go), and
  runc finds them by the container's cgroup (libcontainer: ``signal`` in container_linux.go and
  ``destroy`` in state_linux.go call ``signalAllProcesses`` in init_linux.go, which writes
  ``cgroup.kill`` or freezes the cgroup and signals the pids it lists); kubelet kills what is left in
  a pod's cgroup before removing it. So the supervisor moves into a cgroup of its own
  (:func:`escape_cgroups`). A privileged container gets no cgroup namespace of its own from
  containerd's CRI (internal/cri/server/container_create.go), so it can move there;
- its PID namespace: when a container's init dies in a PID namespace of its own, the kernel kills every
  other process in that namespace (pid_namespaces(7)), which no cgroup move escapes. So this mode needs
  the pod in the host's PID namespace (``hostPID``), where the cgroup is what counts (above);
- the agent's process tree: it is double-forked, so it is no child the agent waits for, and logs to a
  file beside its socket rather than to the container's log pipe, which closes with the container.

Its worker is forked, not executed, from a supervisor that has already imported the modules the worker
runs, so a restarted worker barely reads the image's files (an old image may be garbage-collected while
its shim still serves). The record beside the socket (:class:`ShimHome`) names the supervisor serving the path
and a fingerprint of its code and settings; :mod:`gpushare.crishim.handover` reads it to adopt a shim
or to hand the path over to a new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import pickle
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpushare.kube.retry import Backoff
from gpushare.memlimits.cgroups import cgroup_mounts
from gpushare.process import STOP_SIGNALS
from gpushare.settings import NodeSettings, ShimSettings, socket_path

log = logging.getLogger(__name__)

#: the cgroup the supervisor moves into, in each hierarchy (below the hierarchy's root by default)
ESCAPE_CGROUP = "gpushare-cri-shim"
#: what the supervisor writes to its starter: its worker serves, or why it could not start
READY, FAILED = b"ready\n", b"failed\n"
#: how long a new worker may take to serve (open the cards, start the pod watch)
WORKER_START_SECONDS = 60.0
#: a worker that served this long without dying starts over from the shortest back-off
STABLE_SECONDS = 60.0
#: a log larger than this is moved aside (to ``.1``) when a supervisor starts
LOG_LIMIT = 16 << 20
#: the modules a worker runs, imported before the first fork (see the module's docstring)
WORKER_MODULES = ("gpushare.crishim.wiring", "gpushare.nodewiring", "gpushare.gpus.nvml", "gpushare.gpus.simulated")
PR_SET_PDEATHSIG = 1


class DetachError(RuntimeError):
    """The shim can't be started outside the agent's container."""


@dataclass(frozen=True, slots=True)
class ProcessId:
    """A process, told apart from a later one given the same pid by its start time (``/proc/PID/stat``
    field 22, in clock ticks since boot)."""

    pid: int
    start_time: int

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None
        fields = stat[stat.rindex(")") + 2 :].split()  # the command, in parentheses, may hold spaces
        if fields[0] == "Z":
            return None  # exited, not yet reaped
        return cls(pid, int(fields[19]))

    def alive(self) -> bool:
        return ProcessId.of(self.pid) == self

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


@dataclass(frozen=True, slots=True)
class Record:
    """Which supervisor serves the socket, and what it runs."""

    supervisor: ProcessId
    fingerprint: str


@dataclass(frozen=True, slots=True)
class ShimHome:
    """The files beside the shim's socket: the record (JSON), the starters' lock and the log."""

    socket: Path

    def _beside(self, suffix: str) -> Path:
        return self.socket.with_name(self.socket.name + suffix)

    @property
    def record_path(self) -> Path:
        return self._beside(".shim.json")

    @property
    def lock_path(self) -> Path:
        return self._beside(".shim.lock")

    @property
    def log_path(self) -> Path:
        return self._beside(".shim.log")

    def read(self) -> Record | None:
        try:
            found = json.loads(self.record_path.read_text())
            return Record(ProcessId(found["pid"], found["start_time"]), found["fingerprint"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def write(self, record: Record) -> None:
        """Replace the record in one step, so that a reader never sees half of one."""
        staging = self._beside(f".shim.json.{os.getpid()}")
        pid = record.supervisor
        fields = {"pid": pid.pid, "start_time": pid.start_time, "fingerprint": record.fingerprint}
        staging.write_text(json.dumps(fields))
        os.replace(staging, self.record_path)

    def live(self) -> Record | None:
        """The record, while the supervisor it names runs."""
        record = self.read()
        return record if record is not None and record.supervisor.alive() else None


@dataclass(frozen=True, slots=True)
class DetachedConfig:
    """What a detached shim runs, handed to it on its standard input."""

    node: NodeSettings
    shim: ShimSettings
    fingerprint: str
    #: where the host's cgroup hierarchies are mounted: each one at or below it is escaped
    cgroup_root: Path
    #: the supervisor it takes the socket over from, stopped once this one serves
    replaces: ProcessId | None = None
    #: how long a worker told to stop lets the calls under way finish
    drain_seconds: float = 30.0
    #: escape below this process's cgroup in each hierarchy rather than below the root (tests nest in theirs)
    escape_below: int | None = None


def escape_cgroups(root: Path, below: int | None = None) -> list[Path]:
    """Move this process into :func:`escape_dirs` (made if missing); the cgroups it is in now."""
    moved = escape_dirs(root, below)
    if not moved:
        raise DetachError(f"no cgroup hierarchy is mounted at or under {root}: the shim can't leave the agent's")
    for target in moved:
        made_cgroup(target)
        (target / "cgroup.procs").write_text(str(os.getpid()))
    return moved


def made_cgroup(target: Path) -> Path:
    """``target`` made if missing; in a v1 cpuset hierarchy a new cgroup has no CPUs and no memory nodes
    (no process could join it), so it is given its parent's."""
    target.mkdir(exist_ok=True)
    for name in ("cpuset.cpus", "cpuset.mems"):
        own = target / name
        if own.exists() and not own.read_text().strip():
            own.write_text((target.parent / name).read_text())
    return target


def escape_dirs(root: Path, below: int | None = None) -> list[Path]:
    """:data:`ESCAPE_CGROUP` in every cgroup hierarchy mounted at or under ``root``: below the
    hierarchy's root, or below process ``below``'s cgroup there."""
    own = cgroup_paths(Path(f"/proc/{below}/cgroup").read_text()) if below is not None else {}
    found = []
    for fstype, mount in cgroup_mounts(Path("/proc/self/mountinfo").read_text()):
        if mount != root and root not in mount.parents:
            continue
        base = own.get("" if fstype == "cgroup2" else mount.name, "/")  # v1 mounts are named after their controllers
        found.append(mount / PurePosixPath(base).relative_to("/") / ESCAPE_CGROUP)
    return found


def cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """A process's cgroup in each hierarchy (its ``/proc/PID/cgroup``), keyed by the hierarchy's
    controllers (``""`` for cgroup v2)."""
    found = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        found[controllers.removeprefix("name=")] = path
    return found


# --- the supervisor -------------------------------------------------------------------------------------


class ShimSupervisor:
    """Runs one worker at a time, restarting it with back-off, until SIGTERM: then the worker drains."""

    def __init__(self, config: DetachedConfig, home: ShimHome, me: ProcessId) -> None:
        self._config = config
        self._home = home
        self._me = me
        self._stopping = threading.Event()
        self._worker = 0

    def run(self, report: int) -> int:
        """Serve; ``report`` (a file descriptor) hears once whether the first worker serves."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_stop)
        delays = Backoff(initial=0.5, maximum=30.0).delays()
        first = True
        while not self._stopping.is_set():
            started = time.monotonic()
            serving = self._start_worker()
            if first:
                first = False
                if not serving:
                    os.write(report, FAILED)
                    self._wait_worker()
                    return 1
                self._take_over()
                os.write(report, READY)
                os.close(report)
            self._wait_worker()
            if self._stopping.is_set():
                break
            if time.monotonic() - started >= STABLE_SECONDS:
                delays = Backoff(initial=0.5, maximum=30.0).delays()
            delay = next(delays)
            log.error("CRI shim worker stopped unexpectedly; restarting it in %.1fs", delay)
            self._stopping.wait(delay)
        record = self._home.read()
        if record is not None and record.supervisor == self._me:
            self._home.record_path.unlink(missing_ok=True)
        log.info("detached CRI shim supervisor %d stopping", self._me.pid)
        return 0

    def _on_stop(self, _signum: int, _frame: object) -> None:
        self._stopping.set()
        if self._worker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._worker, signal.SIGTERM)

    def _take_over(self) -> None:
        """Name this supervisor in the record, then stop the one it replaces (whose worker drains)."""
        self._home.write(Record(self._me, self._config.fingerprint))
        if self._config.replaces is not None and self._config.replaces != self._me:
            log.info("took %s over from supervisor %d; it drains", self._config.shim.listen, self._config.replaces.pid)
            self._config.replaces.signal(signal.SIGTERM)

    def _start_worker(self) -> bool:
        """Fork a worker; True once it serves."""
        ready_r, ready_w = os.pipe()
        # held back over the fork: the worker must not miss a SIGTERM sent before its handler is set
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            code = 1
            try:
                code = _worker(self._config, ready_w, self._me.pid)
            except BaseException:
                log.exception("CRI shim worker failed")
            finally:
                logging.shutdown()
                os._exit(code)
        os.close(ready_w)
        self._worker = pid
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        try:
            readable, _, _ = select.select([ready_r], [], [], WORKER_START_SECONDS)
            serving = bool(readable) and os.read(ready_r, 1) == b"1"
        finally:
            os.close(ready_r)
        if not serving:
            log.error("CRI shim worker %d did not start serving; stopping it", pid)
            os.kill(pid, signal.SIGTERM)
        return serving

    def _wait_worker(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(self._worker, 0)
            except ChildProcessError:
                break
            if pid == self._worker:
                log.log(
                    logging.INFO if self._stopping.is_set() else logging.ERROR,
                    "CRI shim worker %d exited (status %d)",
                    pid,
                    os.waitstatus_to_exitcode(status),
                )
                break
        self._worker = 0


def _worker(config: DetachedConfig, ready: int, supervisor: int) -> int:
    """The forked worker: serve until SIGTERM (or the death of its ``supervisor``), then drain."""
    from gpushare.crishim.wiring import api_for, start_cri_shim

    from gpushare.nodewiring import open_cards

    stopping = threading.Event()
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: stopping.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # nobody would restart it
    if os.getppid() != supervisor:  # it died before the line above
        return 1
    backend = open_cards(config.node)
    try:
        running = start_cri_shim(config.node, config.shim, backend, api_for(config.node, config.shim))
        os.write(ready, b"1")
        os.close(ready)
        log.info("detached CRI shim worker %d serving %s", os.getpid(), config.shim.listen)
        stopping.wait()
        log.info("CRI shim worker %d draining (up to %.0fs)", os.getpid(), config.drain_seconds)
        running.drain(config.drain_seconds)
    finally:
        backend.close()
    return 0


def main() -> int:
    """``python -m gpushare.crishim.detached``: read the config on stdin, leave the agent's cgroup and
    process tree, and supervise; stdout hears ``ready`` or ``failed`` once."""
    config: DetachedConfig = pickle.load(sys.stdin.buffer)
    home = ShimHome(socket_path(config.shim.listen))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    report = os.dup(1)
    try:
        escape_cgroups(config.cgroup_root, below=config.escape_below)
        for module in WORKER_MODULES:
            importlib.import_module(module)
    except (OSError, DetachError, ImportError) as exc:
        log.error("can't detach the CRI shim: %s", exc)
        os.write(report, FAILED)
        return 1
    if os.fork() > 0:
        os._exit(0)  # the starter reaps this one; the supervisor below is no child of the agent
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    me = ProcessId.of(os.getpid())
    assert me is not None
    log.info("detached CRI shim supervisor %d for %s", me.pid, config.shim.listen)
    return ShimSupervisor(config, home, me).run(report)


def rotate_log(path: Path) -> None:
    """Move a log past :data:`LOG_LIMIT` aside, so that shims restarted over months don't fill ``/run``."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size > LOG_LIMIT:
            os.replace(path, path.with_name(path.name + ".1"))


if __name__ == "__main__":
    sys.exit(main())
