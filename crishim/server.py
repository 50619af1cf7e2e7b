"""The CRI shim's listener: each kubelet connection is spliced onto its own runtime connection, and
CreateContainer requests are checked before they go on (and, where limits are set, a GPU container's
start sets its own, :mod:`gpushare.crishim.starting`, and a sandbox's end clears its pod's,
:mod:`gpushare.crishim.ending`)."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import stat
import tempfile
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from gpushare.crishim.edge import applied, container_of
from gpushare.crishim.ending import SANDBOX_ENDS, SandboxEnd
from gpushare.crishim.metrics import CORRECTIONS, REFUSALS
from gpushare.crishim.reactor import Reactor
from gpushare.crishim.splice import INTERCEPTED, Forward, Refuse, Splice, Verdict
from gpushare.crishim.starting import CONTAINER_STARTS, ContainerStart

from gpushare.enforcement.decide import Enforcer
from gpushare.pb import cri_pb2
from gpushare.settings import socket_path

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 128
#: threads settling CreateContainer calls (each may wait on the API server)
DECIDE_WORKERS = 8
#: threads forwarding the StopPodSandbox and RemovePodSandbox calls that clear a pod's limits (each waits
#: for the runtime to stop the sandbox)
END_WORKERS = 8
#: threads setting GPU containers' limits at StartContainer (each waits on the runtime and the driver)
START_WORKERS = 8
#: connecting to the runtime's unix socket is immediate unless its backlog is full
CONNECT_TIMEOUT = 0.5


@dataclass(frozen=True, slots=True)
class CreateContainerGuard(Enforcer):
    """Decode CreateContainer, decide about the container (:class:`Enforcer`), re-encode its config with
    the decision's edits."""

    def __call__(self, request: bytes) -> Verdict:
        try:
            decoded = cri_pb2.CreateContainerRequest.FromString(request)
        except DecodeError as exc:
            return Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"CreateContainer request can't be decoded: {exc}")
        _, decision = self.decide(container_of(decoded))
        if decision.refusal is not None:
            REFUSALS.labels(decision.refusal.reason).inc()
            return Refuse(grpc.StatusCode.FAILED_PRECONDITION, decision.refusal.message)
        if decision.edits is None:
            return Forward(request)
        if decision.reason:
            CORRECTIONS.labels(decision.reason).inc()
        decoded.config.CopyFrom(applied(decoded.config, decision.edits))
        return Forward(decoded.SerializeToString())


class CriShim:
    """Listens on a unix socket (mode 0600) and splices every connection onto ``runtime``.

    While the runtime is down, connections are accepted and closed at once, which kubelet's gRPC
    client reports as UNAVAILABLE; once it is back, the next connection reaches it.
    """

    def __init__(
        self,
        listen: str,
        runtime: str,
        guard: CreateContainerGuard,
        sandbox_end: SandboxEnd | None = None,
        container_start: ContainerStart | None = None,
    ) -> None:
        """``sandbox_end`` clears a pod's limits when its sandbox ends, ``container_start`` sets a GPU
        container's as it starts (None: those calls pass untouched)."""
        self.path = socket_path(listen)
        self.runtime = runtime
        self._runtime_path = str(socket_path(runtime))
        #: the held calls' deciders, by path
        self._deciders: dict[bytes, Callable[[bytes], Verdict]] = dict.fromkeys(INTERCEPTED, guard)
        self._reactor = Reactor("cri-shim-io")
        self._pool = futures.ThreadPoolExecutor(max_workers=DECIDE_WORKERS, thread_name_prefix="cri-shim-decide")
        #: a sandbox's stop can take its pod's grace period: its own threads, so CreateContainer never waits
        self._end_pool = futures.ThreadPoolExecutor(max_workers=END_WORKERS, thread_name_prefix="cri-shim-end")
        #: a start waits on the runtime's answers and the driver: its own threads too
        self._start_pool = futures.ThreadPoolExecutor(max_workers=START_WORKERS, thread_name_prefix="cri-shim-start")
        self._pools: dict[bytes, futures.Executor] = dict.fromkeys(INTERCEPTED, self._pool)
        if sandbox_end is not None:
            self._pools.update(dict.fromkeys(SANDBOX_ENDS, self._end_pool))
            self._deciders.update(dict.fromkeys(SANDBOX_ENDS, sandbox_end))
        if container_start is not None:
            self._pools.update(dict.fromkeys(CONTAINER_STARTS, self._start_pool))
            self._deciders.update(dict.fromkeys(CONTAINER_STARTS, container_start))
        self._listener: socket.socket | None = None
        self._splices: set[Splice] = set()
        #: the socket file this shim bound, so that it never removes a newer shim's from its path
        self._bound: tuple[int, int] | None = None
        #: set while draining: called once no connection is left
        self._on_drained: Callable[[], None] | None = None
        self._runtime_down = False
        self.serving = False

    @property
    def address(self) -> str:
        return f"unix://{self.path}"

    def start(self) -> None:
        """Bind in a private directory, tighten the mode, then move the socket into place: nobody can
        connect through a window of looser permissions. The move replaces a socket already there in
        one step (rename(2)), so a shim taking over from another leaves no moment without one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if (self.path.exists() or self.path.is_symlink()) and not stat.S_ISSOCK(self.path.lstat().st_mode):
            raise FileExistsError(f"--listen {self.path} exists and is not a socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        private = Path(tempfile.mkdtemp(prefix=".cri-shim-", dir=self.path.parent))
        try:
            staging = private / "sock"
            listener.bind(str(staging))
            os.chmod(staging, 0o600)
            listener.listen(LISTEN_BACKLOG)
            self._bound = _identity(staging)
            os.rename(staging, self.path)
        except BaseException:
            listener.close()
            raise
        finally:
            for leftover in private.iterdir():
                leftover.unlink()
            private.rmdir()
        listener.setblocking(False)
        self._listener = listener
        self._reactor.register(listener.fileno(), select.EPOLLIN, self._accept)
        self._reactor.start()
        self.serving = True
        log.info("CRI shim listening on %s, forwarding to %s", self.address, self.runtime)

    def alive(self) -> bool:
        """Serving, and the I/O thread that relays every connection still runs."""
        return self.serving and self._reactor.alive

    def stop(self) -> None:
        if not self.serving:
            return
        self.serving = False
        self._reactor.call_soon(self._shut)
        self._reactor.stop()
        for pool in (self._pool, self._end_pool, self._start_pool):  # calls under way hand their verdicts to nobody
            pool.shutdown(wait=True, cancel_futures=True)
        self._reactor.close()
        with contextlib.suppress(FileNotFoundError):
            if _identity(self.path) == self._bound:
                self.path.unlink()

    def drain(self, timeout: float) -> None:
        """Stop as a shim that handed its path to another: accept nothing more, let the calls under way
        on each connection finish (see :meth:`Splice.drain`), and stop once none is left or after
        ``timeout`` seconds (a watch, such as GetContainerEvents, never ends by itself)."""
        if not self.serving:
            return
        drained = threading.Event()

        def begin() -> None:
            assert self._listener is not None
            self._reactor.unregister(self._listener.fileno())
            self._listener.close()
            self._listener = None
            self._on_drained = drained.set
            for splice in list(self._splices):
                splice.drain()
            self._check_drained()

        self._reactor.call_soon(begin)
        drained.wait(timeout)
        self.stop()

    def _check_drained(self) -> None:
        if self._on_drained is not None and not self._splices:
            self._on_drained()

    def _shut(self) -> None:
        if self._listener is not None:
            self._reactor.unregister(self._listener.fileno())
            self._listener.close()
        for splice in list(self._splices):
            splice.close()

    def _closed(self, splice: Splice) -> None:
        self._splices.discard(splice)
        self._check_drained()

    def _accept(self, _events: int) -> None:
        assert self._listener is not None
        while True:
            try:
                kubelet, _ = self._listener.accept()
            except BlockingIOError:
                return
            runtime = self._connect_runtime()
            if runtime is None:
                kubelet.close()
                continue
            splice = Splice(self._reactor, kubelet, runtime, self._decide, self._pools, self._closed)
            self._splices.add(splice)

    def _decide(self, path: bytes, message: bytes) -> Verdict:
        return self._deciders[path](message)

    def _connect_runtime(self) -> socket.socket | None:
        runtime = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        runtime.settimeout(CONNECT_TIMEOUT)
        try:
            runtime.connect(self._runtime_path)
        except OSError as exc:
            runtime.close()
            if not self._runtime_down:
                log.warning("runtime %s unreachable (%s); answering UNAVAILABLE until it is back", self.runtime, exc)
            self._runtime_down = True
            return None
        if self._runtime_down:
            log.info("runtime %s reachable again", self.runtime)
            self._runtime_down = False
        return runtime


def _identity(path: Path) -> tuple[int, int]:
    """Which file ``path`` names (device and inode), whatever was renamed onto it since."""
    found = path.lstat()
    return found.st_dev, found.st_ino
